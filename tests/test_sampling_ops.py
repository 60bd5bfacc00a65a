"""One suite for the sampling operations of generation/sampling_ops.py, run through both of their callers on the same
logits: generate()'s logits processors (the list build_logits_processors makes, as generate() calls it) and the
engine's batched sampler (sampler._warp_rows, every row with its own settings in one batch; the penalties' dense
and sparse forms). Each must equal transformers' processors (the oracle) bit for bit, at the edges too: top_p 1.0
and below float32's resolution, ties at the cut, min_tokens_to_keep, rows that arrive with -inf (all -inf too),
top_k past the vocabulary. And on the same seed the engine draws the token generate() draws."""

from __future__ import annotations

import pytest
import torch
import transformers.generation.logits_process as hf

from gpuformers.engine import sampler
from gpuformers.engine.sequence import SamplingParams, Sequence
from gpuformers.generation import sampling_ops
from gpuformers.generation.config import GenerationConfig
from gpuformers.generation.logits import RepetitionPenaltyLogitsProcessor, build_logits_processors

VOCAB = 300
ROWS = 12


def make_logits(kind: str, seed: int = 0) -> torch.Tensor:
    """(ROWS, VOCAB) float32 logits of one kind:
    random: spread-out scores; ties: small integers, so that many tokens tie at every cut; peaked: one token far
    above the rest, whose probabilities round to 0 in float32 (where top_p=1.0 applied would not be neutral);
    banned: random with banned tokens (-inf, as a bias or a grammar leaves them) and one row banned entirely."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        return torch.randint(-3, 4, (ROWS, VOCAB), generator=g).float()
    logits = torch.randn(ROWS, VOCAB, generator=g) * 3
    if kind == "peaked":
        logits[:, :5] += 120.0
    elif kind == "banned":
        logits[::3, : VOCAB // 2] = float("-inf")
        logits[1] = float("-inf")
    return logits


# The settings of one request: generate()'s kwargs, which are also SamplingParams' for these fields.
SETTINGS = {
    "temperature": dict(temperature=0.7),
    "temperature_hot": dict(temperature=1.3),
    "top_k_1": dict(top_k=1),
    "top_k_5": dict(top_k=5),
    "top_k_vocab": dict(top_k=VOCAB),
    "top_k_past_vocab": dict(top_k=VOCAB + 7),
    "top_p_1": dict(top_p=1.0),
    "top_p_0.9": dict(top_p=0.9),
    "top_p_0.5": dict(top_p=0.5),
    "top_p_tiny": dict(top_p=1e-8),
    "top_p_below_float32": dict(top_p=1e-300),
    "min_p": dict(min_p=0.05),
    "min_p_high": dict(min_p=0.6),
    "min_p_1": dict(min_p=1.0),
    "all": dict(temperature=0.8, top_k=20, top_p=0.8, min_p=0.1),
    "top_k_top_p": dict(top_k=50, top_p=0.6),
    "top_p_min_p": dict(temperature=1.5, top_p=0.95, min_p=0.02),
}
KINDS = ["random", "ties", "peaked", "banned"]


def transformers_warped(logits: torch.Tensor, settings: dict, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """transformers' warpers as its generate() lists them for these settings (each only when set)."""
    temperature, top_k = settings.get("temperature", 1.0), settings.get("top_k", 0)
    top_p, min_p = settings.get("top_p", 1.0), settings.get("min_p")
    warpers = []
    if temperature != 1.0:
        warpers.append(hf.TemperatureLogitsWarper(float(temperature)))
    if top_k:
        warpers.append(hf.TopKLogitsWarper(top_k, min_tokens_to_keep=min_tokens_to_keep))
    if top_p < 1.0:
        warpers.append(hf.TopPLogitsWarper(top_p, min_tokens_to_keep=min_tokens_to_keep))
    if min_p is not None:
        warpers.append(hf.MinPLogitsWarper(min_p, min_tokens_to_keep=min_tokens_to_keep))
    for warper in warpers:
        logits = warper(None, logits)
    return logits


def generate_warped(logits: torch.Tensor, settings: dict) -> torch.Tensor:
    """Our processors as generate() builds and calls them (top_k given: generate's default is 50)."""
    config = GenerationConfig(do_sample=True, **{"top_k": 0, **settings})
    processors = build_logits_processors(config, prompt_length=3)
    return processors(torch.zeros(logits.shape[0], 3, dtype=torch.long), logits)


def engine_warped(logits: torch.Tensor, settings: list[dict]) -> torch.Tensor:
    """The engine's batched path: row i with settings[i]."""
    return sampler._warp_rows(logits, [SamplingParams(do_sample=True, **s) for s in settings])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_both_paths_equal_transformers(name, kind):
    settings = SETTINGS[name]
    logits = make_logits(kind, seed=len(name))
    expected = transformers_warped(logits, settings)
    assert torch.equal(generate_warped(logits, settings), expected), "generate()'s processors"
    assert torch.equal(engine_warped(logits, [settings] * ROWS), expected), "the engine's sampler"
    # the engine's one-row reference (what it runs on the CPU, row by row) too
    one_row = torch.stack([sampler._filter_row(sampling_ops.scale_by_temperature(row, settings.get("temperature", 1.0)),
                                               settings.get("top_k", 0), settings.get("top_p", 1.0),
                                               settings.get("min_p", 0.0)) for row in logits])
    assert torch.equal(one_row, expected), "the engine's one-row filter"


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_mixed_settings_gives_each_row_its_own_result(kind):
    """Every row of one engine step with other settings (so every filter has rows to skip): row i equals
    transformers' warpers for row i's settings alone."""
    logits = make_logits(kind, seed=7)
    names = list(SETTINGS)
    settings = [SETTINGS[names[(i * 5) % len(names)]] for i in range(ROWS)]
    warped = engine_warped(logits, settings)
    for i, s in enumerate(settings):
        assert torch.equal(warped[i], transformers_warped(logits[i:i + 1], s)[0]), (i, s)


def test_the_edges_are_exercised():
    """Guards for the suite above: a tie does fall inside the top_p and top_k cuts (one tied token kept, another
    removed), top_p=1.0 applied would drop the peaked rows' underflowing tail (so leaving it out matters), and every
    filter setting removes tokens somewhere."""
    ties = make_logits("ties")
    kept = hf.TopPLogitsWarper(0.5)(None, ties).isfinite()
    assert any((ties[r][kept[r]].min() == ties[r][~kept[r]]).any() for r in range(ROWS))  # a tie split by the cut
    assert (hf.TopKLogitsWarper(5)(None, ties).isfinite().sum(-1) > 5).all()  # the 5th's ties all stay
    peaked = make_logits("peaked")
    assert not hf.TopPLogitsWarper(1.0)(None, peaked).isfinite().all()
    assert torch.equal(transformers_warped(peaked, SETTINGS["top_p_1"]), peaked)
    for name, settings in SETTINGS.items():
        if name.startswith(("top_k_", "top_p_", "min_p")) and name not in ("top_k_vocab", "top_k_past_vocab",
                                                                              "top_p_1"):
            assert not transformers_warped(make_logits("random"), settings).isfinite().all(), name


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_per_row_tensors_equal_the_processor_of_each_rows_number(kind, keep):
    """The ops with one value per row (tensors, as the engine passes them) against transformers' processor for each
    row's number, min_tokens_to_keep included (beam sampling keeps more than one token); our processor classes,
    the numbers' callers, against the same."""
    logits = make_logits(kind, seed=11)
    top_k = [1, 2, 5, 40, VOCAB, 3, 1, 7, 100, 2, 9, 4]
    top_p = [0.0, 1e-300, 1e-8, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0, 0.1, 0.7, 0.2]
    min_p = [0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0, 0.2, 0.02, 0.6, 0.0]
    temperature = [0.1, 0.5, 0.7, 1.0, 1.3, 2.0, 0.9, 1.1, 0.3, 3.0, 0.6, 1.7]
    ours = {
        "top_k": sampling_ops.top_k_filter(logits, torch.tensor(top_k), keep, max_top_k=max(top_k)),
        "top_k_sorted": sampling_ops.top_k_filter(logits, torch.tensor(top_k), keep),  # no bound: a full sort
        "top_p": sampling_ops.top_p_filter(logits, torch.tensor(top_p, dtype=torch.float64), keep),
        "min_p": sampling_ops.min_p_filter(logits, torch.tensor(min_p), keep),
        "temperature": sampling_ops.scale_by_temperature(logits, torch.tensor(temperature)),
    }
    from gpuformers.generation import warpers

    for i in range(ROWS):
        row = logits[i:i + 1]
        oracle = {"top_k": hf.TopKLogitsWarper(top_k[i], min_tokens_to_keep=keep),
                  "top_p": hf.TopPLogitsWarper(top_p[i], min_tokens_to_keep=keep),
                  "min_p": hf.MinPLogitsWarper(min_p[i], min_tokens_to_keep=keep),
                  "temperature": hf.TemperatureLogitsWarper(temperature[i])}
        classes = {"top_k": warpers.TopKLogitsWarper(top_k[i], min_tokens_to_keep=keep),
                   "top_p": warpers.TopPLogitsWarper(top_p[i], min_tokens_to_keep=keep),
                   "min_p": warpers.MinPLogitsWarper(min_p[i], min_tokens_to_keep=keep),
                   "temperature": warpers.TemperatureLogitsWarper(temperature[i])}
        for op, result in ours.items():
            name = op.removesuffix("_sorted")
            expected = oracle[name](None, row)[0]
            assert torch.equal(result[i], expected), (op, i)
            assert torch.equal(classes[name](None, row)[0], expected), (name, i)


def test_top_p_tie_at_the_cut():
    """Four tied tokens of probability 0.25 each (exact in float32) and top_p=0.5: the cut falls on the tie, and
    both paths drop the two tokens transformers drops (torch.sort's order among the tied ones)."""
    logits = torch.tensor([[1.0, 1.0, float("-inf"), 1.0, 1.0]]).repeat(3, 1)
    expected = hf.TopPLogitsWarper(0.5)(None, logits)
    assert expected.isfinite().sum(-1).tolist() == [2, 2, 2]
    assert torch.equal(generate_warped(logits, dict(top_p=0.5)), expected)
    assert torch.equal(engine_warped(logits, [dict(top_p=0.5)] * 3), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_repetition_penalty_through_both_paths(kind):
    """transformers' RepetitionPenaltyLogitsProcessor, per row its own penalty, against our processor (generate())
    and the engine's dense (GPU) and sparse (CPU) penalties over a table of the tokens each row has seen."""
    logits = make_logits(kind, seed=3)
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, VOCAB, (ROWS, 40), generator=g)
    input_ids[:, :8] = torch.arange(8)  # seen tokens among the banned ones (-inf stays -inf)
    penalties = [1.3, 0.7, 1.0, 2.0, 0.5, 1.1, 1.7, 0.9, 3.0, 1.05, 0.3, 1.5]
    expected = torch.cat([hf.RepetitionPenaltyLogitsProcessor(p)(input_ids[i:i + 1], logits[i:i + 1])
                          for i, p in enumerate(penalties)])
    generate = torch.cat([RepetitionPenaltyLogitsProcessor(p)(input_ids[i:i + 1], logits[i:i + 1])
                          for i, p in enumerate(penalties)])
    assert torch.equal(generate, expected)
    # The engine's tables: the ids as each row's prompt, no output yet.
    in_prompt = torch.zeros(ROWS, VOCAB, dtype=torch.bool).scatter(1, input_ids, True)
    output = torch.zeros(ROWS, VOCAB, dtype=torch.int32)
    zeros = torch.zeros(ROWS, 1)
    args = (logits, torch.arange(ROWS), output, in_prompt, torch.tensor(penalties)[:, None], zeros, zeros)
    assert torch.equal(sampler._penalise_dense(*args), expected)
    assert torch.equal(sampler._penalise_sparse(*args), expected)
    assert not torch.equal(expected, logits)


def test_the_engine_draws_the_token_generate_draws():
    """For the same logits and seed, the engine's sampled token is the one torch.multinomial draws from
    transformers' warped probabilities with that seed (generate() and transformers draw so on the CPU): greedy,
    filtered and plain rows mixed in one step."""
    logits = make_logits("random", seed=9)
    names = list(SETTINGS)
    settings = [SETTINGS[names[i % len(names)]] for i in range(ROWS)]
    for step in range(3):
        params = [SamplingParams(do_sample=True, seed=100 + i, **s) for i, s in enumerate(settings)]
        sequences = [Sequence(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
        tokens = sampler.sample_on_device(logits, sequences, sampler.TokenCounts(torch.device("cpu")))[0]
        expected = [int(torch.multinomial(transformers_warped(logits[i:i + 1], s).softmax(-1)[0], 1,
                                          generator=torch.Generator().manual_seed(100 + i)))
                    for i, s in enumerate(settings)]
        assert tokens.tolist() == expected
        logits = logits.roll(step + 1, dims=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_both_paths_equal_transformers_on_cuda_without_a_host_sync():
    """On CUDA, where torch divides by a host number as a product with its reciprocal (temperature, the repetition
    penalty), the engine's per-row tensors give transformers' numbers too, and its batched path never waits for
    the device."""
    names = list(SETTINGS)
    for kind in KINDS:
        logits = make_logits(kind, seed=2).cuda()
        for settings in SETTINGS.values():
            expected = transformers_warped(logits, settings)
            assert torch.equal(generate_warped(logits, settings), expected), (kind, settings)
            assert torch.equal(engine_warped(logits, [settings] * ROWS), expected), (kind, settings)
        mixed = [SETTINGS[names[(i * 5) % len(names)]] for i in range(ROWS)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            warped = engine_warped(logits, mixed)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for i, s in enumerate(mixed):
            assert torch.equal(warped[i], transformers_warped(logits[i:i + 1], s)[0]), (kind, i, s)
        input_ids = torch.randint(0, VOCAB, (ROWS, 40), device="cuda")
        penalties = [1.3, 0.7, 1.0, 2.0, 0.5, 1.1, 1.7, 0.9, 3.0, 1.05, 0.3, 1.5]
        expected = torch.cat([hf.RepetitionPenaltyLogitsProcessor(p)(input_ids[i:i + 1], logits[i:i + 1])
                              for i, p in enumerate(penalties)])
        in_prompt = torch.zeros(ROWS, VOCAB, dtype=torch.bool, device="cuda").scatter(1, input_ids, True)
        zeros = torch.zeros(ROWS, 1, device="cuda")
        dense = sampler._penalise_dense(logits, torch.arange(ROWS, device="cuda"),
                                        torch.zeros(ROWS, VOCAB, dtype=torch.int32, device="cuda"), in_prompt,
                                        torch.tensor(penalties, device="cuda")[:, None], zeros, zeros)
        assert torch.equal(dense, expected), kind
