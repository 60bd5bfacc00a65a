"""The best checkpoint (load_best_model_at_end, metric_for_best_model, save_strategy="best"), by transformers'
rules: what it needs, which evaluation beats the best so far, and loading the best weights at the end.

Offers: check_best_model_setup, update_best_metric, load_best_model, keep_only_best_checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

from gpuformers import distributed
from gpuformers.training import checkpoint as ckpt
from gpuformers.training.arguments import TrainingArguments
from gpuformers.training.callbacks import TrainerState


def check_best_model_setup(args: TrainingArguments, eval_dataset, model, gathers_states: bool) -> None:
    """load_best_model_at_end / save_strategy="best": what they need. gathers_states: the model is sharded (FSDP2)
    or split (tensor parallelism), so its checkpoints hold gathered whole weights."""
    asked = "load_best_model_at_end" if args.load_best_model_at_end else 'save_strategy="best"'
    if args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(f'{asked} with eval_strategy "{args.eval_strategy}" needs an eval_dataset to compare the '
                         "checkpoints on; pass eval_dataset to the Trainer")
    if args.save_strategy == "best" and (args.metric_for_best_model is None or args.eval_strategy == "no"):
        raise ValueError('save_strategy="best" saves when an evaluation beats the best metric: it needs '
                         'metric_for_best_model (e.g. "loss") and an eval_strategy ("steps" or "epoch")')
    if args.load_best_model_at_end and gathers_states and hasattr(model, "peft_config"):
        kind = "FSDP2" if args.distributed_strategy == "fsdp" else "tensor parallelism"
        raise NotImplementedError(f"load_best_model_at_end with LoRA under {kind} is not supported (the checkpoints "
                                  "hold the adapter alone, which is not loaded back into split weights); drop "
                                  "load_best_model_at_end and load the best checkpoint's adapter after training, or "
                                  "train with DDP or one process")


def metric_key(metric_for_best_model: str) -> str:
    """The evaluate() key metric_for_best_model names ("eval_" is optional there)."""
    name = metric_for_best_model
    return name if name.startswith("eval_") else f"eval_{name}"


def update_best_metric(args: TrainingArguments, state: TrainerState, metrics: dict[str, float]) -> bool:
    """transformers' rule: metric_for_best_model ("eval_" added) beats state.best_metric -> a new best (True); its
    step is the best checkpoint's when a checkpoint is written at that step."""
    name = args.metric_for_best_model
    if name is None:
        return False
    key = metric_key(name)
    if key not in metrics:
        raise KeyError(f"metric_for_best_model {name!r} ({key}) is not among the evaluation's metrics "
                       f"{sorted(metrics)}; pass one of them (the 'eval_' prefix is optional)")
    value, greater = float(metrics[key]), args.greater_is_better
    if state.best_metric is None:  # a NaN is never the best, as in transformers
        state.best_metric = -math.inf if greater else math.inf
    if not ((value > state.best_metric) if greater else (value < state.best_metric)):
        return False
    state.best_metric = value
    if args.save_strategy != "no":
        state.best_global_step = state.global_step
    return True


def load_best_model(model, state: TrainerState, gathers_states: bool) -> None:
    """The best checkpoint's weights into the model, in place (the optimizer keeps its tensors); every process
    reads the whole weights, a sharded or split model keeping its part."""
    best = Path(state.best_model_checkpoint)
    if gathers_states:
        distributed.load_full_model_state_dict(model, ckpt.read_model_weights(best))
    else:
        ckpt.load_model_weights_in_place(model, best)


def keep_only_best_checkpoint(output_dir: str, state: TrainerState) -> None:
    """save_total_limit=1: the newest checkpoint, kept while training for a resume, goes when it is not the best
    (as in transformers)."""
    if distributed.is_main_process():
        best = Path(state.best_model_checkpoint).resolve()
        for path in ckpt.sorted_checkpoints(output_dir):
            if path.resolve() != best:
                ckpt.remove_checkpoint(path)  # renamed first: a crash never leaves a checkpoint-N half deleted
    distributed.barrier()
