"""Benchmark: memory per process of the data-parallel strategies, same model, same run, 2 CPU processes.

The claim (docs/training.md, "Which strategy, and what it saves"): with N processes, DDP keeps the whole model,
gradients and Adam state in every process; ZeRO-2 shards the gradients and the optimizer state; ZeRO-3 and FSDP2's
full sharding shard the parameters too. Each strategy trains the same ~100M-parameter Qwen3-shaped model (float32,
AdamW, batch 1 x 128 tokens per process, a few steps) under torchrun with 2 processes (gloo; DeepSpeed's CPU
accelerator), one strategy after another; each process reports the bytes of the tensors it still holds after train()
(parameters, gradients, optimizer state: what the strategy keeps), its resident memory after loading the model and
after train(), and its peak (ru_maxrss: the whole life of the process, loading included). The allocator keeps freed
memory resident, so RSS also counts what ZeRO-3 gathered and freed layer by layer; every process loads the whole model
before sharding (no zero.Init).

    python benchmarks/bench_strategies_memory.py                 # ddp, fsdp, zero2, zero3 (~2 minutes on 2 cores)
    python benchmarks/bench_strategies_memory.py --strategies ddp zero3 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=True)
ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto"}
# the bucket sizes "auto" (from hidden_size, as transformers' example configs have them): DeepSpeed's own defaults
# (5e8 elements) hold buffers of up to 2 GiB in float32
BUCKETS = {"reduce_bucket_size": "auto", "allgather_bucket_size": 2**22}
STRATEGIES = {"ddp": {}, "fsdp": {"fsdp": "full_shard"},
              "zero2": {"deepspeed": {**ZERO, "zero_optimization": {"stage": 2, **BUCKETS}}},
              "zero3": {"deepspeed": {**ZERO, "zero_optimization": {
                  "stage": 3, **BUCKETS, "stage3_prefetch_bucket_size": "auto",
                  "stage3_param_persistence_threshold": "auto"}}}}


def rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def live_tensor_gib() -> float:
    """The bytes of every distinct tensor storage that Python objects still hold (parameters, gradients, optimizer
    state, DeepSpeed's flat partitions): what the strategy keeps, apart from what the allocator kept after freeing
    (RSS) and from tensors held in C++ alone (DDP's gradient buckets, not counted)."""
    import gc

    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            continue
        try:  # FSDP2's DTensors and their local shards; a storage already freed raises
            storage = (obj.to_local() if hasattr(obj, "to_local") else obj).untyped_storage()
            pointer = storage.data_ptr()
        except RuntimeError:
            continue
        if pointer and pointer not in seen:
            seen.add(pointer)
            total += storage.nbytes()
    return total / 2**30


def worker(checkpoint: str, strategy: str, steps: int, out: str) -> None:
    import torch

    from gpuformers import AutoModelForCausalLM
    from gpuformers.distributed import exit_process
    from gpuformers.training import Trainer, TrainingArguments

    torch.set_num_threads(1)
    if "deepspeed" in STRATEGIES[strategy]:
        import deepspeed.ops

        # the shared-memory all-reduce op (inference only) is a minute of C++ build: gloo carries training's
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    params = sum(p.numel() for p in model.parameters())
    loaded = rss_gib()
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, SHAPE["vocab_size"], (128,), generator=generator).tolist()}
            for _ in range(2 * steps)]
    args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=steps, optim="adamw_torch",
                             save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True,
                             **STRATEGIES[strategy])
    trainer = Trainer(model, args, train_dataset=rows)
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    report = {"rank": args.process_index, "params": params, "loaded": loaded, "trained": rss_gib(), "peak": peak,
              "live": live_tensor_gib(),
              "loss": trainer.state.log_history[-2].get("loss")}
    Path(out, f"{strategy}_{args.process_index}.json").write_text(json.dumps(report))
    exit_process()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("CHECKPOINT", "STRATEGY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker[:2], args.steps, args.worker[2])
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, out = Path(tmp, "model"), Path(tmp, "out")
        out.mkdir()
        make_checkpoint(checkpoint, SHAPE)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        rows = []
        for strategy in args.strategies:
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                   __file__, "--steps", str(args.steps), "--worker", str(checkpoint), strategy,
                                   str(out)], env=env, capture_output=True, text=True, timeout=900)
            if done.returncode:
                print(done.stdout[-2000:], done.stderr[-4000:])
                raise SystemExit(f"{strategy} failed")
            reports = [json.loads(Path(out, f"{strategy}_{rank}.json").read_text()) for rank in (0, 1)]
            rows.append((strategy, reports))
        params = rows[0][1][0]["params"]
        print(f"{params / 1e6:.1f}M parameters (float32: {params * 4 / 2**30:.2f} GiB of weights), 2 processes, "
              f"{args.steps} steps of 1 x 128 tokens each, AdamW")
        print("| strategy | live tensors after train() (GiB) | RSS after load | RSS after train() | peak RSS | "
              "last loss |")
        print("| --- | --- | --- | --- | --- | --- |")
        for strategy, reports in rows:
            def pair(key: str) -> str:
                return " / ".join(f"{r[key]:.2f}" for r in reports)

            print(f"| {strategy} | {pair('live')} | {pair('loaded')} | {pair('trained')} | {pair('peak')} | "
                  f"{reports[0]['loss']:.4f} |")


if __name__ == "__main__":
    main()
