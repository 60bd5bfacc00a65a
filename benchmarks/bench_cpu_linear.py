"""CPU matmuls of a decode or engine step: F.linear (MKL, which packs the weight on every call) against the weight
packed once for oneDNN (kernels/cpu_linear.py), over one pass of a Qwen3-shaped model's linear layers and its LM
head at each row count. The layers' weights add up to far more than the caches, so each pass reads them from
memory as a real step does. Prints ms per pass, the ratio, and which one generate() and the engine take at that
row count on this machine (packed_faster: its own quick measurement, printed first, or GPUFORMERS_CPU_PACKED_ROWS).

    python benchmarks/bench_cpu_linear.py                       # 100M shape, 1 thread
    python benchmarks/bench_cpu_linear.py --rows 1 4 16 64 --repeats 10
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {  # (hidden, layers, kv_heads * head_dim, intermediate, vocab), as bench_offline.py's
    "100m": (768, 12, 256, 2048, 32000),
    "0.6b": (1024, 28, 1024, 3072, 151936),
}


def model_weights(shape: str) -> list[torch.Tensor]:
    """(out, in) weights of every linear layer of the stack, then the LM head."""
    hidden, layers, kv, inter, vocab = SHAPES[shape]
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
                 (hidden, inter)]
    return [torch.randn(o, i) * 0.02 for _ in range(layers) for o, i in per_layer] + [torch.randn(vocab, hidden)]


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> None:
    from gpuformers.kernels.cpu_linear import _PACK_HINT_ROWS, calibration, packed_faster, prepack_available

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 48, 64, 128, 192, 256, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not prepack_available():
        raise SystemExit("this torch build has no oneDNN: nothing to compare")
    torch.set_num_threads(args.threads)
    print("calibration (ms for 32 MB of weights, F.linear / packed): " + ", ".join(
        f"{rows} rows {plain:.2f} / {fast:.2f}" for rows, (plain, fast) in calibration().items()))
    weights = model_weights(args.shape)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS) for w in weights]
    print(f"{args.shape}: {sum(w.numel() for w in weights) / 1e6:.0f}M weights, {args.threads} thread(s); "
          f"ms per pass over every linear layer and the LM head")
    print(f"{'rows':>5} {'F.linear':>9} {'packed':>9} {'ratio':>6}  gpuformers uses")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in weights}}

            def mkl():
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)

            def onednn():
                for w, p in zip(weights, packed):
                    torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

            ours, theirs = timed(onednn, args.repeats), timed(mkl, args.repeats)
            print(f"{rows:5d} {theirs * 1e3:9.1f} {ours * 1e3:9.1f} {theirs / ours:6.2f}  "
                  f"{'packed' if packed_faster(rows) else 'F.linear'}")


if __name__ == "__main__":
    main()
