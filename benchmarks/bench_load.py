"""Benchmark: from_pretrained wall time and peak memory, gpuformers vs transformers, on a Qwen3-0.6B-shaped checkpoint.

The claim: our loader streams each tensor straight into its final place, so loading a checkpoint costs about
its size in resident memory (peak RSS / checkpoint size <= 1.2), and is no slower than transformers.

A random bfloat16 checkpoint with Qwen3-0.6B's shapes (hidden 1024, 28 layers, vocab 151936, tied embeddings)
is written once into a cache folder. Each measurement then runs in a fresh subprocess (imports done before the
clock starts), 3 times per library, interleaved; the table shows medians.

    python benchmarks/bench_load.py            # Qwen3-0.6B shape, ~1.2 GB, cached in ~/.cache/gpuformers/bench_load
    python benchmarks/bench_load.py --quick    # a small shape, seconds
    python benchmarks/bench_load.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
)  # fmt: skip
QUICK = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip

# Runs in a fresh interpreter. Peak memory is VmHWM (Linux), not ru_maxrss: ru_maxrss survives exec, so the
# child would report the parent's peak (the parent wrote the checkpoint). Elsewhere ru_maxrss is the fallback.
_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    which, folder, device = sys.argv[1:4]

    def rss(field):
        try:
            line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
            return int(line.split()[1]) * 1024
        except OSError:
            scale = 1 if sys.platform == "darwin" else 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    if which == "gpuformers":
        import gpuformers.models.qwen3
        from gpuformers import AutoModelForCausalLM
        kwargs = {"progress": False}
    else:
        import transformers
        from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
        transformers.utils.logging.disable_progress_bar()
        kwargs = {}
    before = rss("VmRSS")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", device_map=device, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # A loader may return weights still on disk (mmapped, read on first use): read every weight once, so
    # that "ready" time and peak memory compare models that are really in memory.
    with torch.no_grad():  # one byte of every 4 KiB page: every weight is then really in memory, cheaply
        total = sum(int(p.detach().reshape(-1).view(torch.uint8)[::4096].sum()) for p in model.parameters())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ready = time.perf_counter() - start
    assert next(model.parameters()).dtype == torch.bfloat16
    print(json.dumps({"seconds": seconds, "ready": ready, "peak_extra": rss("VmHWM") - before}))
""")


def write_checkpoint(folder: Path, shape: dict) -> int:
    """Write the random bfloat16 checkpoint once (config.json is written last: its presence marks it complete)."""
    weights = folder / "model.safetensors"
    if (folder / "config.json").is_file() and weights.is_file():
        return weights.stat().st_size
    import torch
    import transformers

    from gpuformers.loading.save import save_checkpoint

    config = transformers.Qwen3Config(**shape, dtype="bfloat16")
    with torch.device("meta"):
        skeleton = transformers.Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, meta in skeleton.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings, as in the real checkpoint
        if name.endswith("norm.weight"):
            state[name] = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16)
    print(f"writing a {sum(t.numel() for t in state.values()) / 1e6:.0f}M-parameter checkpoint to {folder} ...",
          file=sys.stderr)
    save_checkpoint(state, folder, config=config.to_dict(), max_shard_size="20GB")
    return weights.stat().st_size


def measure(which: str, folder: Path, device: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, which, str(folder), device], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{which} failed to load {folder}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python benchmarks/bench_load.py --quick --repeats 3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small shape (vocab 32000, 4 layers) instead of Qwen3-0.6B"
    )
    parser.add_argument("--repeats", type=int, default=3, help="subprocess runs per library; the median is shown")
    parser.add_argument("--device", default="cpu", help='where to load: "cpu" (default) or "cuda"')
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "gpuformers" / "bench_load",
                        help="where the random checkpoint is written once and reused")
    args = parser.parse_args(argv)

    name = "qwen3-quick" if args.quick else "qwen3-0.6b"
    folder = args.cache_dir / name
    size = write_checkpoint(folder, QUICK if args.quick else QWEN3_0_6B)
    with open(folder / "model.safetensors", "rb") as f:  # warm the page cache, so that no run pays the first read
        while f.read(64 << 20):
            pass

    runs: dict[str, list[dict]] = {"gpuformers": [], "transformers": []}
    for _ in range(args.repeats):
        for which in runs:  # interleaved, so that drift on the machine hits both alike
            runs[which].append(measure(which, folder, args.device))
    keys = ("seconds", "ready", "peak_extra")
    medians = {which: [statistics.median(r[k] for r in rs) for k in keys] for which, rs in runs.items()}

    print(f"\ncheckpoint: {name}, bfloat16, {size / 1e9:.3f} GB in 1 file ({folder}); device {args.device}; "
          f"median of {args.repeats} fresh processes")
    print("load s: from_pretrained; ready s: that plus reading every weight once; peak RSS: above RSS after imports")
    print(f"{'':14} {'load s':>9} {'ready s':>9} {'peak RSS GB':>12} {'peak RSS / checkpoint':>22}")
    for which, (seconds, ready, peak) in medians.items():
        print(f"{which:14} {seconds:9.3f} {ready:9.3f} {peak / 1e9:12.3f} {peak / size:22.2f}")
    ours, hf = medians["gpuformers"], medians["transformers"]
    print(f"{'ours / theirs':14} {ours[0] / hf[0]:8.2f}x {ours[1] / hf[1]:8.2f}x {ours[2] / max(hf[2], 1):11.2f}x")
    ours_m = ours[2]
    print(f"memory goal: peak RSS / checkpoint <= 1.2 -> {'met' if ours_m / size <= 1.2 else 'NOT met'} "
          f"({ours_m / size:.2f})")


if __name__ == "__main__":
    main()
