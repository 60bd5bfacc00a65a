"""Benchmark: the engine's per-step penalty work (repetition, frequency and presence penalties), whole rows against
only the tokens each row has seen, on the same tables in the same run.

The claim (docs/engine.md): on the CPU, changing only the seen tokens (`_penalise_sparse`, what the engine runs
there) costs a fraction of the whole-row version (`_penalise_dense`, what it runs on a GPU, where `nonzero()` would
wait for the device) at serving sizes: 64 penalised rows, a 152k vocabulary, 200 prompt and 100 output tokens each.
Both give the same numbers (tests/engine/test_penalties.py). The whole adjusting step (`_adjust_logits`: table rows,
then the penalties) is timed too, as the engine calls it.

    python benchmarks/bench_sampler.py                 # CPU, one thread
    python benchmarks/bench_sampler.py --device cuda   # both versions on a GPU (the engine uses dense there)
"""

from __future__ import annotations

import argparse
import time

import torch

from gpuformers.engine import sampler
from gpuformers.engine.sequence import SamplingParams, Sequence


def timed(fn, device: str, repeats: int) -> float:
    """Best of `repeats` calls, in milliseconds."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per row")
    parser.add_argument("--output", type=int, default=100, help="output tokens counted per row")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)

    params = SamplingParams(max_new_tokens=args.output, repetition_penalty=1.1, frequency_penalty=0.5,
                            presence_penalty=0.3)
    sequences = [Sequence(f"r{i}", torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist(), params)
                 for i in range(args.rows)]
    counts = sampler.TokenCounts(device)
    table_rows = counts.rows_of(sequences, args.vocab)
    for _ in range(args.output):  # each row's output tokens, counted as the engine counts them
        counts.add(table_rows, torch.randint(0, args.vocab, (args.rows,), generator=g).to(device))
    logits = torch.randn(args.rows, args.vocab, generator=g).to(device)
    index = torch.arange(args.rows, device=device)
    tables = (counts.output.index_select(0, table_rows), counts.in_prompt.index_select(0, table_rows))
    scale = [torch.full((args.rows, 1), v, device=device) for v in (1.1, 0.5, 0.3)]

    dense = timed(lambda: sampler._penalise_dense(logits, index, *tables, *scale), args.device, args.repeats)
    sparse = timed(lambda: sampler._penalise_sparse(logits, index, *tables, *scale), args.device, args.repeats)
    step = timed(lambda: sampler._adjust_logits(logits, sequences, list(range(args.rows)), counts), args.device,
                 args.repeats)
    print(f"{args.rows} rows x {args.vocab} vocab, {args.prompt} prompt + {args.output} output tokens per row, "
          f"{args.device}, {args.threads} thread(s)")
    print(f"whole rows (dense)   {dense:8.1f} ms")
    print(f"seen tokens (sparse) {sparse:8.1f} ms   ({dense / sparse:.1f}x faster)")
    print(f"engine step ({'sparse' if device.type == 'cpu' else 'dense'}) {step:8.1f} ms   (_adjust_logits: rows, "
          f"tables, penalties)")


if __name__ == "__main__":
    main()
