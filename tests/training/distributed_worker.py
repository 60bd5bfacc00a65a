"""One process of a distributed training run, for tests/training/test_distributed_trainer.py:
`torchrun --nproc_per_node=2 -m tests.training.distributed_worker CHECKPOINT OUTPUT_DIR RUN [--max-steps N]
[--stop-at N] [--resume] [--zero-init]`, RUN one of the named configurations in RUNS. With ddp and the fsdp variants each process
trains on its share of every batch (1 row x 2 accumulated micro-batches: with 2 processes, global batches of 4); with
tp (the model loaded with tp_plan="auto") every process takes the whole batch (2 rows x 2 micro-batches) on its
slices of the model; process 0 writes the logged losses and gradient norms (and what compute_metrics saw) to
OUTPUT_DIR/losses.json and the final weights to OUTPUT_DIR/final; every process writes predict()'s logits over the
eval rows to OUTPUT_DIR/predictions_RANK.npy. --zero-init (ZeRO-3 runs): the TrainingArguments are made before
from_pretrained, which then builds the model partitioned (deepspeed.zero.Init); each process writes what it holds of
each parameter to OUTPUT_DIR/partitions_RANK.json, and process 0 the weights gathered from the partitions to
OUTPUT_DIR/gathered.safetensors, before training."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from gpuformers import AutoModelForCausalLM
from gpuformers.training import Trainer, TrainerCallback
from gpuformers.distributed import exit_process
from tests.training.helpers import make_rows, tiny_args

ROWS = dict(count=24, seed=3)
EVAL_ROWS = dict(count=7, seed=9)  # odd: one process gets a padding row, which must not count
DISTRIBUTED_ARGS = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, save_steps=3,
                        save_strategy="steps", lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01,
                        max_grad_norm=1.0, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=2)
DEEPSPEED_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "train_batch_size": "auto", "gradient_clipping": "auto"}
# the named configurations: TrainingArguments on top of DISTRIBUTED_ARGS
RUNS = {
    "ddp": {},
    "tp": {"per_device_train_batch_size": 2},
    "fsdp": {"fsdp": "full_shard"},
    "shard_grad_op": {"fsdp": "shard_grad_op"},
    # torchrun's LOCAL_WORLD_SIZE (2) is the default shard size: a 1 x 2 (replicate, shard) mesh
    "hybrid_shard": {"fsdp": "hybrid_shard"},
    # dp_shard_size=1: a 2 x 1 mesh, each process a whole replica, gradients all-reduced over the replicate dim;
    # with the parameters, gradients and optimizer state offloaded to the CPU and the fused AdamW stepping there
    "hybrid_shard_zero2_offload": {"fsdp": "hybrid_shard_zero2 offload", "fsdp_config": {"dp_shard_size": 1},
                                   "optim": "adamw_torch_fused"},
    "offload": {"fsdp": "full_shard offload", "optim": "adamw_torch_fused"},
    # DeepSpeed's engine (its CPU accelerator, over gloo) with the Trainer's AdamW and cosine schedule; every value
    # the arguments decide left "auto", the weights gathered by save_model
    "zero3": {"deepspeed": {**DEEPSPEED_AUTO, "zero_optimization": {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}},
    # accelerate launch --use_deepspeed --zero_stage 2: the environment alone asks for DeepSpeed
    "accelerate": {},
}


def argmax_ids(logits, labels):
    return logits.argmax(-1)  # preprocess_logits_for_metrics: ids, not (rows, seq, vocab) logits, are kept


def metrics(prediction) -> dict[str, float]:
    """What compute_metrics saw: its row count, the sum of its labels and the next-token accuracy."""
    ids = prediction.predictions if prediction.predictions.ndim == 2 else prediction.predictions.argmax(-1)
    ids, labels = ids[:, :-1], prediction.label_ids[:, 1:]
    real = labels != -100
    return {"rows": float(len(labels)), "label_sum": float(labels[real].sum()),
            "accuracy": float((ids[real] == labels[real]).mean())}


class CountEvalBatches(TrainerCallback):
    def __init__(self):
        self.count = 0

    def on_prediction_step(self, args, state, control, **kwargs):
        self.count += 1


class RecordLayout(TrainerCallback):
    """How FSDP2 holds the first decoder layer's weights: the mesh shape, the placements, the offload policy, and
    whether they are still gathered right after the layer's training forward (reshard_after_forward=False)."""

    def __init__(self):
        self.layout = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        layer = model.model.layers[0]
        if not isinstance(layer, FSDPModule):
            return
        weight = next(layer.parameters())  # between steps: the sharded DTensor
        group = layer._get_fsdp_state()._fsdp_param_group  # private: FSDP2 has no public getter for the policy
        self.layout = {"mesh": list(weight.device_mesh.shape), "placements": [str(p) for p in weight.placements],
                       "offload": type(group.offload_policy).__name__}
        layer.register_forward_hook(self._after_forward)  # after FSDP2's own hook, which may reshard

    def _after_forward(self, module, inputs, output):
        if module.training and "gathered_after_forward" not in self.layout:
            self.layout["gathered_after_forward"] = not isinstance(next(module.parameters()), DTensor)


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def skip_deepspeed_shm_build() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op (C++, JIT: about a minute on CI's two cores)
    when its communication starts. Only its inference all-reduce uses that op (training's collectives go through
    torch.distributed, gloo here), so the tests answer DeepSpeed's probe of compatible ops with no for it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def record_partitions(model, output_dir: Path, rank: int) -> None:
    """name -> [whole shape, elements of the whole, elements this process holds, shape of the parameter itself]
    (DeepSpeed's ds_shape / ds_numel / ds_tensor); process 0 also saves the weights gathered from every process."""
    import deepspeed
    from safetensors.torch import save_file

    held = {name: [list(p.ds_shape), p.ds_numel, p.ds_tensor.numel(), list(p.shape)]
            for name, p in model.named_parameters()}
    (output_dir / f"partitions_{rank}.json").write_text(json.dumps(held))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # a collective: every process
        if rank == 0:
            save_file({name: p.detach().clone() for name, p in model.named_parameters()},
                      output_dir / "gathered.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("output_dir")
    parser.add_argument("run", choices=list(RUNS))
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-at", type=int, help="end training after this step (its checkpoint is written)")
    parser.add_argument("--zero-init", action="store_true", help="ZeRO-3: the model built partitioned")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tp = args.run == "tp"
    if args.run in ("zero3", "accelerate"):
        skip_deepspeed_shm_build()
    values = {**DISTRIBUTED_ARGS, **RUNS[args.run], "max_steps": args.max_steps, "use_cpu": True}
    # made before from_pretrained, a ZeRO-3 config is in force for it (as in transformers): a partitioned model
    training_args = tiny_args(args.output_dir, **values) if args.zero_init else None
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, progress=False, tp_plan="auto" if tp else None)
    if args.zero_init:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        record_partitions(model, Path(args.output_dir), training_args.process_index)
    eval_batches, layout = CountEvalBatches(), RecordLayout()
    trainer = Trainer(model, training_args or tiny_args(args.output_dir, **values),
                      train_dataset=make_rows(**ROWS), eval_dataset=make_rows(**EVAL_ROWS), compute_metrics=metrics,
                      preprocess_logits_for_metrics=argmax_ids,
                      callbacks=[eval_batches, layout] + ([StopAt(args.stop_at)] if args.stop_at else []))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    with trainer.args.main_process_first(local=False):  # process 0 writes its line first, then the other
        with open(Path(args.output_dir) / "first.txt", "a") as f:
            f.write(f"{trainer.args.process_index}\n")
    (Path(args.output_dir) / f"process_{trainer.args.process_index}.json").write_text(json.dumps(
        [trainer.is_world_process_zero(), trainer.is_local_process_zero(), trainer.args.world_size,
         trainer.args.distributed_strategy]))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(Path(args.output_dir) / "final")
    trainer.preprocess_logits_for_metrics = None  # predict: the whole logits, gathered from every process
    predicted = trainer.predict(make_rows(**EVAL_ROWS))
    np.save(Path(args.output_dir) / f"predictions_{trainer.args.process_index}.npy", predicted.predictions)
    (Path(args.output_dir) / f"eval_batches_{trainer.args.process_index}.json").write_text(str(eval_batches.count))
    if trainer.args.process_index == 0:
        losses = {e["step"]: [e["loss"], e["grad_norm"]] for e in trainer.state.log_history if "loss" in e}
        losses.update({f"eval{e['step']}": e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e})
        losses.update({f"metrics{e['step']}": [e["eval_rows"], e["eval_label_sum"], e["eval_accuracy"]]
                       for e in trainer.state.log_history if "eval_loss" in e})
        (Path(args.output_dir) / "losses.json").write_text(json.dumps(losses))
        (Path(args.output_dir) / "layout.json").write_text(json.dumps(layout.layout))


if __name__ == "__main__":
    main()
    exit_process()
