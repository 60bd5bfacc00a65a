"""CPU matmuls of a decode or engine step in each form of the weights (kernels/cpu_matmul_probe.py): F.linear on
the weight as nn.Linear keeps it (ROWS, what transformers runs), on a transposed copy (COLUMNS), and on a copy
packed once for oneDNN (PACKED), over one pass of a Qwen3-shaped model's linear layers and its LM head at each
row count, q/k/v and gate/up concatenated as kernels/cpu_linear.py groups them. The weights add up to more than
the caches, so each pass reads them from memory as a real step does.

Prints ms per pass for each form, then "ours": the pass with the forms gpuformers takes on this machine (at one
row each group's fastest form for its shape, as generate() at batch 1 keeps them; at more rows PACKED where
packed_faster says so, as the engine and generate() at larger batches do), and F.linear's time over ours. The
measurements behind those choices (calibration, one_row_form) are printed first.

    python benchmarks/bench_cpu_linear.py                       # 100M shape, 1 thread
    python benchmarks/bench_cpu_linear.py --shape tiny --rows 1 4 8
    python benchmarks/bench_cpu_linear.py --shape 0.6b --rows 1 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {  # (hidden, layers, q heads * head_dim, kv_heads * head_dim, intermediate, vocab)
    "tiny": (256, 8, 256, 128, 768, 16384),  # bench_generate.py's tiny Qwen3
    "100m": (768, 12, 768, 256, 2048, 32000),  # bench_offline.py's
    "0.6b": (1024, 28, 2048, 1024, 3072, 151936),  # Qwen3-0.6B
}


def model_weights(shape: str) -> list[torch.Tensor]:
    """(out, in) weights of every group of the stack (q/k/v, o, gate/up, down), then the LM head."""
    hidden, layers, q, kv, inter, vocab = SHAPES[shape]
    per_layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return [torch.randn(o, i) * 0.02 for _ in range(layers) for o, i in per_layer] + [torch.randn(vocab, hidden)]


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> None:
    from gpuformers.kernels.cpu_matmul_probe import (COLUMNS, PACK_HINT_ROWS, PACKED, ROWS, calibration,
                                                     one_row_form, packed_faster, prepack_available)

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
    one_row = [one_row_form(w.shape[1], w.shape[0]) for w in weights]
    by_shape = {tuple(w.shape): form for w, form in zip(weights, one_row)}  # (out, in) -> form
    print("fastest at one row (one_row_form): " + ", ".join(f"{o}x{i} {form}" for (o, i), form in by_shape.items()))
    copies = {ROWS: weights, COLUMNS: [w.t().contiguous().t() for w in weights],
              PACKED: [torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS) for w in weights]}
    print(f"{args.shape}: {sum(w.numel() for w in weights) / 1e6:.0f}M weights, {args.threads} thread(s); "
          f"ms per pass over every linear layer and the LM head")
    print(f"{'rows':>5} {'F.linear':>9} {'columns':>9} {'packed':>9} {'ours':>9} {'ratio':>6}")
    pointwise = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in weights}}

            def run(forms):
                for i, (w, form) in enumerate(zip(weights, forms)):
                    x = inputs[w.shape[1]]
                    pointwise(x, copies[PACKED][i], None, "none", [], "") if form == PACKED \
                        else F.linear(x, copies[form][i])

            ours = one_row if rows == 1 else [PACKED if packed_faster(rows) else ROWS] * len(weights)
            times = {name: timed(lambda forms=forms: run(forms), args.repeats) for name, forms in (
                (ROWS, [ROWS] * len(weights)), (COLUMNS, [COLUMNS] * len(weights)),
                (PACKED, [PACKED] * len(weights)), ("ours", ours))}
            print(f"{rows:5d} " + " ".join(f"{t * 1e3:9.1f}" for t in times.values())
                  + f" {times[ROWS] / times['ours']:6.2f}")


if __name__ == "__main__":
    main()
