"""Benchmark: the engine's per-step penalty work (repetition, frequency and presence penalties), whole rows against
only the tokens each row has seen, on the same tables in the same run; and its sampled rows (temperature > 0), one
row at a time against all together.

The claim (docs/engine.md): on the CPU, changing only the seen tokens (`_penalise_sparse`, what the engine runs
there) costs a fraction of the whole-row version (`_penalise_dense`, what it runs on a GPU, where `nonzero()` would
wait for the device) at serving sizes: 64 penalised rows, a 152k vocabulary, 200 prompt and 100 output tokens each.
Both give the same numbers (tests/engine/test_penalties.py). The whole adjusting step (`_adjust_logits`: table rows,
then the penalties) is timed too, as the engine calls it.

    python benchmarks/bench_sampler.py                 # CPU, one thread
    python benchmarks/bench_sampler.py --device cuda   # both versions on a GPU (the engine uses dense there)
    python benchmarks/bench_sampler.py --skip-penalties --sample-rows 256 --vocab 32000   # sampling only
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


def sampling_params(rows: int) -> list[SamplingParams]:
    """Requests as a server sees them: most with no filter (OpenAI's default temperature 1), others with top_p,
    top_k, min_p or all three; every other one seeded."""
    kinds = [{}, dict(top_p=0.9), {}, dict(top_k=50), dict(min_p=0.05), dict(temperature=0.7, top_k=40, top_p=0.95,
                                                                                min_p=0.02)]
    return [SamplingParams(do_sample=True, seed=i if i % 2 else None, **kinds[i % len(kinds)]) for i in range(rows)]


def one_row_at_a_time(logits: torch.Tensor, sequences: list[Sequence], draw) -> torch.Tensor:
    """The engine's sampling before it was batched: about ten ops per row."""
    tokens = torch.zeros(len(sequences), dtype=torch.long, device=logits.device)
    for i, seq in enumerate(sequences):
        p = seq.params
        row = sampler._filter_row(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
        tokens[i] = draw(row.softmax(-1), seq.generator)
    return tokens


def count_ops(fn) -> int:
    """The torch ops one call of fn dispatches (on a GPU, its kernel launches)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def batched(logits: torch.Tensor, sequences: list[Sequence], draw) -> torch.Tensor:
    """sampler._sample_rows with the given draw (the GPU's race on the CPU too)."""
    original = sampler._draw_rows
    sampler._draw_rows = draw
    try:
        return sampler._sample_rows(logits, sequences)
    finally:
        sampler._draw_rows = original


def bench_sampling(args, device: torch.device, g: torch.Generator) -> None:
    sequences = [Sequence(f"s{i}", [1], p) for i, p in enumerate(sampling_params(args.sample_rows))]
    for seq in sequences:
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
    logits = (3 * torch.randn(args.sample_rows, args.vocab, generator=g)).to(device)
    multinomial = lambda probs, generator: torch.multinomial(probs, 1, generator=generator)[0]  # noqa: E731
    race = sampler._exponential_race
    batched_race = sampler._draw_rows if device.type == "cuda" else sampler._exponential_rows
    cases = [("one row at a time, multinomial", lambda: one_row_at_a_time(logits, sequences, multinomial)),
             ("one row at a time, race", lambda: one_row_at_a_time(logits, sequences, race)),
             ("all rows, multinomial per row", lambda: batched(logits, sequences, sampler._draw_rows)),
             ("all rows, race", lambda: batched(logits, sequences, batched_race))]
    if device.type == "cuda":
        cases = [case for case in cases if "multinomial" not in case[0]]  # it read probabilities back: syncs
    print(f"\n{args.sample_rows} sampled rows x {args.vocab} vocab (mixed filters, half seeded), {args.device}")
    for name, fn in cases:
        print(f"{name:32} {timed(fn, args.device, args.repeats):8.1f} ms   {count_ops(fn):6d} ops")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per row")
    parser.add_argument("--output", type=int, default=100, help="output tokens counted per row")
    parser.add_argument("--sample-rows", type=int, default=64, help="sampled rows (0: skip the sampling part)")
    parser.add_argument("--skip-penalties", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    if not args.skip_penalties:
        bench_penalties(args, device, g)
    if args.sample_rows:
        bench_sampling(args, device, g)


def bench_penalties(args, device: torch.device, g: torch.Generator) -> None:
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
