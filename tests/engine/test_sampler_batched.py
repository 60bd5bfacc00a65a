"""The sampled rows of a step drawn together (sampler._sample_rows) against one row at a time (_filter_row, then
_exponential_race or torch.multinomial with the row's generator): the same kept tokens for mixed per-row filters,
the same tokens for seeded rows whatever their neighbours, and a kernel count that does not grow with the rows.
The GPU draw (_exponential_rows) runs on the CPU here; the gpu test runs the engine's CUDA path."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpuformers.engine import sampler
from gpuformers.engine.sequence import SamplingParams, Sequence

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def mixed_params(rows: int, vocab: int, seed: int, seeded: float = 0.5) -> list[SamplingParams]:
    """Sampled requests with every mix of filters: top_k off, 1, small, the whole vocabulary and past it; top_p off,
    usual, tight and below float32's smallest step; min_p off and on; a seed or none."""
    rng = random.Random(seed)
    return [SamplingParams(do_sample=True, temperature=rng.choice([0.5, 0.7, 1.0, 1.3]),
                           top_k=rng.choice([0, 0, 1, 5, 50, vocab, vocab + 7]),
                           top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 1e-300]), min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
                           seed=rng.randrange(10**6) if rng.random() < seeded else None)
            for _ in range(rows)]


def one_row_at_a_time(logits: torch.Tensor, params: list[SamplingParams], draw, generators=None) -> list[int]:
    """The engine's sampling before it was batched: each row filtered, softmaxed and drawn on its own, a seeded row
    with its generator in `generators` (None: a fresh one of its seed, as the engine makes at a request's first
    step); None for a greedy row."""
    generators = generators or [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    tokens = []
    for row, p, generator in zip(logits, params, generators):
        if p.greedy:
            tokens.append(None)
            continue
        probs = sampler._filter_row(row / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
        tokens.append(int(draw(probs, generator)))
    return tokens


def multinomial(probs, generator):
    return torch.multinomial(probs, 1, generator=generator)[0]


def test_filters_keep_what_the_one_row_filter_keeps():
    """Per-row top_k, top_p and min_p in one pass give _filter_row's logits exactly (its kept set, and the kept
    logits untouched), for every mix of filters in one batch."""
    for case, vocab in enumerate([50, 1000, 4096]):
        g = torch.Generator().manual_seed(case)
        logits = torch.randn(64, vocab, generator=g) * 3
        logits[::7, : vocab // 3] = float("-inf")  # rows that arrive with banned tokens (bias, grammar)
        params = mixed_params(64, vocab, seed=case)
        expected = torch.stack([sampler._filter_row(row, p.top_k, p.top_p, p.min_p) for row, p in zip(logits, params)])
        assert torch.equal(sampler._filter_rows(logits, params), expected), vocab
        # one filter kind for the whole batch, and no filter at all
        for only in [dict(top_k=7), dict(top_p=0.8), dict(min_p=0.1), {}]:
            same = [SamplingParams(do_sample=True, **only)] * 64
            expected = torch.stack([sampler._filter_row(row, s.top_k, s.top_p, s.min_p) for row, s in zip(logits, same)])
            assert torch.equal(sampler._filter_rows(logits, same), expected), only


def test_a_tail_below_float32_resolution_survives_top_p_1():
    """A row without top_p keeps every token, also those past where the cumulative mass rounds to 1.0 (a top_p of
    1.0 given to it as a neutral value would drop them)."""
    logits = torch.cat([torch.full((1, 20), 30.0), torch.zeros(1, 1000)], dim=-1)  # the zeros: ~1e-13 each
    logits = logits.repeat(2, 1)
    params = [SamplingParams(do_sample=True), SamplingParams(do_sample=True, top_p=0.5)]
    kept = sampler._filter_rows(logits, params).isfinite()
    assert kept[0].all() and kept[1].sum() < 20


def test_the_gpu_draw_of_all_rows_is_each_rows_own():
    """From the same generator state, the batched race picks the token each row's race picks alone (the same noise,
    drawn per seeded row), whatever rows share the step; unseeded rows draw from the default generator."""
    g = torch.Generator().manual_seed(0)
    vocab = 3000
    logits = torch.randn(48, vocab, generator=g) * 3
    params = mixed_params(48, vocab, seed=1)
    sequences = [Sequence(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    assert 10 < len(seeded) < 38
    expected = one_row_at_a_time(logits, params, sampler._exponential_race)
    tokens = race(logits, sequences).tolist()
    assert [tokens[i] for i in seeded] == [expected[i] for i in seeded]
    # The seeded rows alone, in another order, with other neighbours: the same tokens.
    order = seeded[::-1]
    others = [Sequence(f"n{i}", [1, 2], p) for i, p in enumerate(mixed_params(len(order), vocab, seed=2, seeded=0))]
    mixed = [x for pair in zip([sequences[i] for i in order], others) for x in pair]
    rows = torch.stack([x for i in order for x in (logits[i], torch.randn(vocab, generator=g))])
    for seq in mixed:
        seq.generator = None  # a fresh start from each seed
    assert race(rows, mixed).tolist()[::2] == [expected[i] for i in order]


def race(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """The engine's sampled tokens with the GPU's draw (the exponential race), on the CPU."""
    original = sampler._draw_rows
    sampler._draw_rows = sampler._exponential_rows
    try:
        return sampler._sample_rows(logits, sequences)
    finally:
        sampler._draw_rows = original


def test_seeded_cpu_samples_are_unchanged():
    """On the CPU the engine still draws each sampled row with torch.multinomial: a seeded request gets the tokens
    one row at a time gave (those generate() and transformers give), greedy rows beside it or not."""
    g = torch.Generator().manual_seed(3)
    vocab = 2000
    params = mixed_params(40, vocab, seed=4, seeded=1.0)
    params[::5] = [SamplingParams()] * len(params[::5])  # greedy rows in between
    sequences = [Sequence(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    counts = sampler.TokenCounts(torch.device("cpu"))
    for _ in range(3):  # each step continues each row's generator
        logits = torch.randn(40, vocab, generator=g) * 3
        expected = one_row_at_a_time(logits, params, multinomial, generators)
        expected = [int(logits[i].argmax()) if p.greedy else expected[i] for i, p in enumerate(params)]
        assert sampler.sample_on_device(logits, sequences, counts)[0].tolist() == expected


def test_the_kernels_of_a_step_do_not_grow_with_its_sampled_rows():
    """Filters, softmax and draw of unseeded rows cost the same ops for 4 rows as for 64 (one row at a time cost
    about ten per row); a seeded row adds its noise."""

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def ops(rows: int, seeded: int) -> int:
        # odd rows with every filter (three of them seeded), even rows with none: each filter has rows to skip
        params = [SamplingParams(do_sample=True, top_k=20, top_p=0.9, min_p=0.05, seed=i if i < 2 * seeded else None)
                  if i % 2 else SamplingParams(do_sample=True, temperature=0.7) for i in range(rows)]
        sequences = [Sequence(f"r{i}", [1], p) for i, p in enumerate(params)]
        logits = torch.randn(rows, 500)
        with Count() as count:
            race(logits, sequences)
        return count.ops

    assert ops(4, 0) == ops(64, 0)
    assert ops(64, 3) <= ops(64, 0) + 3 * 2  # each seeded row: a view and a draw of noise


@pytest.mark.gpu
@needs_cuda
def test_cuda_samples_are_those_of_one_row_at_a_time():
    """On a GPU the batched path gives the tokens the per-row race gives (temperature as CUDA divides by a host
    number, the same filters, each seeded row's own noise)."""
    g = torch.Generator().manual_seed(6)
    vocab = 32000
    params = mixed_params(64, vocab, seed=7, seeded=1.0)
    sequences = [Sequence(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    logits = (torch.randn(64, vocab, generator=g) * 3).cuda()
    expected = []
    for row, p in zip(logits, params):
        probs = sampler._filter_row(row / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
        expected.append(int(sampler._exponential_race(probs, torch.Generator("cuda").manual_seed(p.seed))))
    counts = sampler.TokenCounts(torch.device("cuda"))
    assert sampler.sample_on_device(logits, sequences, counts)[0].tolist() == expected
