"""Benchmark: training throughput and memory, gpuformers' Trainer vs transformers' Trainer, same run.

The claim: on the same Qwen3-shaped model, the same data (fixed-length rows of random tokens, so no padding) and the
same arguments (AdamW, fused by default as both Trainers default to, linear schedule, clipping at 1.0, float32
weights with bf16 autocast on a GPU), our Trainer trains at least as many tokens per second as transformers' and
peaks at no more memory. On a GPU it also reports
model FLOPs utilisation (MFU): 6 * parameters (+ attention) FLOPs per token, over the GPU's dense bf16 peak.

Each trainer runs in its own child process (so peak memory is its own), alternately, `--repeats` times; a step is
timed from on_step_begin to on_step_end (with a CUDA sync), the first `--warmup` steps are dropped, and the table
shows the best round's median step (a round the shared machine slowed down does not decide it). Memory per step:
torch.cuda.max_memory_allocated (reset every step) on a GPU, the process's peak RSS on the CPU (libraries, model,
optimizer state and activations together; the RSS before train() is shown beside it, since transformers and
accelerate alone cost more resident memory than gpuformers).

    python benchmarks/bench_train.py --quick                      # tiny Qwen3 shape on the CPU, 3 rounds, ~1 minute
    python benchmarks/bench_train.py --optim adamw_torch          # AdamW's per-parameter loop on both sides
    python benchmarks/bench_train.py --threads 1 --clock cpu      # CPU time of one thread: steady on a busy machine
    python benchmarks/bench_train.py --device cuda --shape qwen3-0.6b --batch 8 --seq 1024
    python benchmarks/bench_train.py --device cuda --shape qwen3-0.6b --use-kernels   # our fused kernels too
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=4096, tie_word_embeddings=True),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=16384, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}
# dense bf16 tensor-core peak in TFLOP/s, by a word in torch.cuda.get_device_name(); --peak-tflops overrides
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}


def make_checkpoint(folder: Path, shape: dict) -> None:
    import torch
    import transformers

    config = transformers.Qwen3Config(**shape, max_position_embeddings=40960, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def flops_per_token(shape: dict, seq: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters, plus attention scores (12 x layers x q-width x seq / 2,
    causal)."""
    h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    params = layers * per_layer + h * shape["vocab_size"]  # lm_head counts; the embedding lookup does not
    return 6 * params + 12 * layers * q * seq / 2


def worker(opts) -> dict:
    """One trainer in this process; prints {"step_seconds": [...], "peak_bytes": [...]} as JSON."""
    import torch
    import torch._dynamo  # noqa: F401 - torch.optim imports it on first use; import it up front in both processes

    rows = [{"input_ids": row} for row in json.loads(Path(opts.rows).read_text())]
    device = torch.device(opts.device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    # --clock cpu: this thread's CPU time. With one torch thread every op of a CPU step runs on it (autograd included,
    # no dataloader workers), so time the shared machine gives to other processes is not counted.
    clock = time.thread_time if opts.clock == "cpu" else time.perf_counter
    step_times, peaks = [], []

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    class Timer:
        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self.start = clock()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            step_times.append(clock() - self.start)
            peaks.append(torch.cuda.max_memory_allocated() if device.type == "cuda"
                         else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    common = dict(output_dir=opts.out, per_device_train_batch_size=opts.batch, max_steps=opts.steps,
                  learning_rate=1e-4, optim=opts.optim,
                  save_strategy="no", logging_steps=10**6, report_to="none", disable_tqdm=True, bf16=opts.bf16,
                  use_cpu=device.type == "cpu", train_sampling_strategy="sequential", seed=0)
    from gpuformers.training.data import DataCollatorForCausalLM

    collator = DataCollatorForCausalLM(pad_token_id=0)
    if opts.worker == "ours":
        from gpuformers import AutoModelForCausalLM
        from gpuformers.training import Trainer, TrainerCallback, TrainingArguments

        kwargs = {"use_kernels": True} if opts.use_kernels else {}
        model = AutoModelForCausalLM.from_pretrained(opts.folder, dtype="float32", device_map=opts.device,
                                                     progress=False, **kwargs)
        trainer = Trainer(model, TrainingArguments(**common), train_dataset=rows, data_collator=collator,
                          callbacks=[type("T", (Timer, TrainerCallback), {})()])
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(opts.folder, dtype=torch.float32).to(device)
        trainer = transformers.Trainer(model, transformers.TrainingArguments(**common), train_dataset=rows,
                                       data_collator=collator,
                                       callbacks=[type("T", (Timer, transformers.TrainerCallback), {})()])
    before = _current_rss() if device.type == "cpu" else torch.cuda.memory_allocated()
    trainer.train()
    return {"step_seconds": step_times, "peak_bytes": peaks, "before_bytes": before}


def _current_rss() -> int:
    """Resident memory of this process now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, few steps (CPU smoke run)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (default on cuda)")
    parser.add_argument("--optim", default="adamw_torch_fused", choices=["adamw_torch_fused", "adamw_torch"],
                        help="the optimizer of both Trainers (default: their default, torch's fused AdamW, which "
                             "has a CPU kernel too)")
    parser.add_argument("--use-kernels", action="store_true", help="also run ours with use_kernels=True")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each trainer (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time steps by the wall clock, or by the CPU time of the trainer's thread (needs "
                             "--threads 1 and the CPU: then steady on a machine shared with other work)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", choices=["ours", "ours+kernels", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        opts.use_kernels = opts.worker == "ours+kernels"
        opts.worker = "ours" if opts.worker.startswith("ours") else "hf"
        print("RESULT " + json.dumps(worker(opts)))
        return
    if opts.quick:
        # alternate the two trainers 3 times: on a shared machine one quiet or busy moment would decide it otherwise
        opts.shape, opts.batch, opts.seq, opts.steps, opts.warmup, opts.repeats = "tiny", 4, 128, 16, 3, 3
    opts.bf16 = opts.bf16 or opts.device.startswith("cuda")
    if opts.clock == "cpu" and (opts.threads != 1 or opts.device != "cpu"):
        parser.error(f"--clock cpu times one thread: it needs --threads 1 and --device cpu (got --threads "
                     f"{opts.threads}, --device {opts.device}); use --clock wall otherwise")
    shape = SHAPES[opts.shape]

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_checkpoint(tmp / "model", shape)
        generator = torch.Generator().manual_seed(0)
        rows = torch.randint(3, shape["vocab_size"], (opts.batch * opts.steps, opts.seq), generator=generator)
        (tmp / "rows.json").write_text(json.dumps(rows.tolist()))
        kinds = ["hf", "ours"] + (["ours+kernels"] if opts.use_kernels else [])
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for repeat in range(opts.repeats):
            for kind in kinds:
                command = [sys.executable, __file__, "--worker", kind, "--folder", str(tmp / "model"),
                           "--rows", str(tmp / "rows.json"), "--out", str(tmp / f"out-{kind}"),
                           "--device", opts.device, "--batch", str(opts.batch), "--steps", str(opts.steps),
                           "--optim", opts.optim, "--clock", opts.clock]
                command += ["--threads", str(opts.threads)] if opts.threads else []
                command += ["--bf16"] if opts.bf16 else []
                done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
                line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
                if done.returncode != 0 or line is None:
                    print(f"{kind} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                    continue
                results[kind].append(json.loads(line[len("RESULT "):]))

    tokens = opts.batch * opts.seq
    peak = opts.peak_tflops
    if peak is None and opts.device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    table = {}
    for kind, runs in results.items():
        if not runs:
            continue
        median = min(statistics.median(run["step_seconds"][opts.warmup:]) for run in runs)  # the best round
        row = {"tokens_per_second": tokens / median, "step_ms": median * 1e3,
               "peak_memory_gib": max(max(run["peak_bytes"]) for run in runs) / 2**30,
               "before_train_gib": max(run["before_bytes"] for run in runs) / 2**30}
        if peak:
            row["mfu"] = flops_per_token(shape, opts.seq) * tokens / median / (peak * 1e12)
        table[kind] = row
    print(f"shape {opts.shape}, batch {opts.batch} x seq {opts.seq}, device {opts.device}, "
          f"{'bf16 autocast' if opts.bf16 else 'float32'}, {opts.optim}, {opts.steps} steps ({opts.warmup} warmup) x "
          f"{opts.repeats} repeats, torch threads {opts.threads or torch.get_num_threads()}, {opts.clock} clock")
    print(f"{'trainer':<14}{'tokens/s':>12}{'step ms':>10}{'peak GiB':>10}{'before train':>14}"
          + (f"{'MFU':>8}" if peak else ""))
    for kind, row in table.items():
        print(f"{kind:<14}{row['tokens_per_second']:>12.0f}{row['step_ms']:>10.1f}{row['peak_memory_gib']:>10.3f}"
              f"{row['before_train_gib']:>14.3f}" + (f"{row['mfu']:>8.1%}" if peak else ""))
    if not opts.device.startswith("cuda"):
        print("CPU memory is the process's peak RSS (libraries, model, optimizer state, activations); 'before "
              "train' is the RSS with the libraries imported and the model loaded (our CPU load maps the weights, "
              "so they count only once touched)")
    if "hf" in table and "ours" in table:
        print(f"ours / transformers: {table['ours']['tokens_per_second'] / table['hf']['tokens_per_second']:.2f}x "
              f"tokens/s, {table['ours']['peak_memory_gib'] / table['hf']['peak_memory_gib']:.2f}x peak memory")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "results": table}, indent=2))


if __name__ == "__main__":
    main()
