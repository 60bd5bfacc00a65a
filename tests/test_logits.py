"""Logits processors: the same processed scores as transformers' classes on the same random input, and the same
list, in the same order, from the same generation config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpuformers.generation import logits as L
from gpuformers.generation.config import GenerationConfig

VOCAB = 40
BATCH = 4


def _scores(seed: int = 0, batch: int = BATCH, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3


def _ids(seed: int = 0, batch: int = BATCH, seq: int = 12, high: int = 6) -> torch.Tensor:
    # a small id range so that tokens and n-grams repeat
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randint(0, high, (batch, seq), generator=g)


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "different tokens were filtered out"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


# (name, our processor, transformers class name, transformers kwargs)
CASES = [
    ("temperature", lambda: L.TemperatureLogitsWarper(0.7), "TemperatureLogitsWarper", dict(temperature=0.7)),
    ("top_k", lambda: L.TopKLogitsWarper(5), "TopKLogitsWarper", dict(top_k=5)),
    ("top_k_keep", lambda: L.TopKLogitsWarper(2, min_tokens_to_keep=4), "TopKLogitsWarper",
     dict(top_k=2, min_tokens_to_keep=4)),
    ("top_p", lambda: L.TopPLogitsWarper(0.8), "TopPLogitsWarper", dict(top_p=0.8)),
    ("top_p_zero", lambda: L.TopPLogitsWarper(0.0, min_tokens_to_keep=2), "TopPLogitsWarper",
     dict(top_p=0.0, min_tokens_to_keep=2)),
    ("min_p", lambda: L.MinPLogitsWarper(0.1), "MinPLogitsWarper", dict(min_p=0.1)),
    ("min_p_keep", lambda: L.MinPLogitsWarper(0.9, min_tokens_to_keep=3), "MinPLogitsWarper",
     dict(min_p=0.9, min_tokens_to_keep=3)),
    ("typical_p", lambda: L.TypicalLogitsWarper(0.7), "TypicalLogitsWarper", dict(mass=0.7)),
    ("epsilon", lambda: L.EpsilonLogitsWarper(0.03), "EpsilonLogitsWarper", dict(epsilon=0.03)),
    ("eta", lambda: L.EtaLogitsWarper(0.05), "EtaLogitsWarper", dict(epsilon=0.05)),
    ("repetition_penalty", lambda: L.RepetitionPenaltyLogitsProcessor(1.3), "RepetitionPenaltyLogitsProcessor",
     dict(penalty=1.3)),
    ("repetition_penalty_soft", lambda: L.RepetitionPenaltyLogitsProcessor(0.6),
     "RepetitionPenaltyLogitsProcessor", dict(penalty=0.6)),
    ("repetition_penalty_ignore_int", lambda: L.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=5),
     "RepetitionPenaltyLogitsProcessor", dict(penalty=1.5, prompt_ignore_length=5)),
    ("repetition_penalty_ignore_rows",
     lambda: L.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([0, 3, 7, 11])),
     "RepetitionPenaltyLogitsProcessor", dict(penalty=1.5, prompt_ignore_length=torch.tensor([0, 3, 7, 11]))),
    ("no_repeat_ngram_2", lambda: L.NoRepeatNGramLogitsProcessor(2), "NoRepeatNGramLogitsProcessor",
     dict(ngram_size=2)),
    ("no_repeat_ngram_3", lambda: L.NoRepeatNGramLogitsProcessor(3), "NoRepeatNGramLogitsProcessor",
     dict(ngram_size=3)),
    ("no_repeat_ngram_1", lambda: L.NoRepeatNGramLogitsProcessor(1), "NoRepeatNGramLogitsProcessor",
     dict(ngram_size=1)),
    ("bad_words_single", lambda: L.NoBadWordsLogitsProcessor([[3], [7], [11]], eos_token_id=3),
     "NoBadWordsLogitsProcessor", dict(bad_words_ids=[[3], [7], [11]], eos_token_id=3)),
    ("bad_words_multi", lambda: L.NoBadWordsLogitsProcessor([[1, 2], [4, 5, 30], [2, 9], [0, 1, 2, 3]]),
     "NoBadWordsLogitsProcessor", dict(bad_words_ids=[[1, 2], [4, 5, 30], [2, 9], [0, 1, 2, 3]])),
    ("bad_words_mixed", lambda: L.NoBadWordsLogitsProcessor([[5], [3, 4], [1, 1], [39]], eos_token_id=[39, 2]),
     "NoBadWordsLogitsProcessor", dict(bad_words_ids=[[5], [3, 4], [1, 1], [39]], eos_token_id=[39, 2])),
    ("min_length_active", lambda: L.MinLengthLogitsProcessor(15, 3), "MinLengthLogitsProcessor",
     dict(min_length=15, eos_token_id=3)),
    ("min_length_done", lambda: L.MinLengthLogitsProcessor(12, [3, 8]), "MinLengthLogitsProcessor",
     dict(min_length=12, eos_token_id=[3, 8])),
    ("min_new_tokens_int", lambda: L.MinNewTokensLengthLogitsProcessor(10, 4, 3),
     "MinNewTokensLengthLogitsProcessor", dict(prompt_length_to_skip=10, min_new_tokens=4, eos_token_id=3)),
    ("min_new_tokens_list", lambda: L.MinNewTokensLengthLogitsProcessor(9, 5, [3, 8, 39]),
     "MinNewTokensLengthLogitsProcessor", dict(prompt_length_to_skip=9, min_new_tokens=5, eos_token_id=[3, 8, 39])),
    ("min_new_tokens_done", lambda: L.MinNewTokensLengthLogitsProcessor(8, 4, [3, 8]),
     "MinNewTokensLengthLogitsProcessor", dict(prompt_length_to_skip=8, min_new_tokens=4, eos_token_id=[3, 8])),
    ("forced_eos", lambda: L.ForcedEOSTokenLogitsProcessor(13, [3, 8]), "ForcedEOSTokenLogitsProcessor",
     dict(max_length=13, eos_token_id=[3, 8])),
    ("suppress", lambda: L.SuppressTokensLogitsProcessor([1, 4, 9]), "SuppressTokensLogitsProcessor",
     dict(suppress_tokens=[1, 4, 9])),
    ("suppress_at_begin", lambda: L.SuppressTokensAtBeginLogitsProcessor([2, 6], 12),
     "SuppressTokensAtBeginLogitsProcessor", dict(begin_suppress_tokens=[2, 6], begin_index=12)),
    ("normalization", lambda: L.LogitNormalization(), "LogitNormalization", {}),
    ("top_h", lambda: L.TopHLogitsWarper(0.5), "TopHLogitsWarper", dict(top_h=0.5)),
    ("sequence_bias", lambda: L.SequenceBiasLogitsProcessor([[[1, 2], -2.0], [[4], 3.5], [[5, 3], 1.0]]),
     "SequenceBiasLogitsProcessor", dict(sequence_bias=[[[1, 2], -2.0], [[4], 3.5], [[5, 3], 1.0]])),
    ("exponential_decay", lambda: L.ExponentialDecayLengthPenalty((1, 1.5), [3, 8], 10),
     "ExponentialDecayLengthPenalty", dict(exponential_decay_length_penalty=(1, 1.5), eos_token_id=[3, 8],
                                           input_ids_seq_length=10)),
]


@pytest.mark.parametrize("name, make_ours, hf_name, hf_kwargs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_processor_matches_transformers(name, make_ours, hf_name, hf_kwargs, seed):
    import transformers.generation.logits_process as hf_lp

    theirs = getattr(hf_lp, hf_name)(**hf_kwargs)
    ours = make_ours()
    scores, ids = _scores(seed), _ids(seed)
    if name.startswith("bad_words"):
        # make some rows end with the prefixes of the multi-token entries
        ids[0, -1:] = torch.tensor([1])
        ids[1, -2:] = torch.tensor([4, 5])
        ids[2, -3:] = torch.tensor([0, 1, 2])
        ids[3, -1:] = torch.tensor([3])
    before = scores.clone()
    out = ours(ids, scores)
    assert torch.equal(scores, before), f"{name} changed its input scores in place"
    expected = theirs(ids, scores.clone())
    _assert_same(out, expected)


def test_processors_do_something():
    """Guard against a vacuous parity: the cases above change the scores they are given."""
    scores, ids = _scores(), _ids()
    for name, make_ours, *_ in CASES:
        if name in ("min_length_done", "min_new_tokens_done"):
            assert torch.equal(make_ours()(ids, scores), scores)
        else:
            assert not torch.equal(make_ours()(ids, scores), scores), name


def test_no_repeat_ngram_bans_exactly_the_repeats():
    ids = torch.tensor([[1, 2, 3, 1, 2]])  # next token 3 would repeat "1 2 3"
    out = L.NoRepeatNGramLogitsProcessor(3)(ids, torch.zeros(1, 6))
    assert torch.isinf(out).nonzero().tolist() == [[0, 3]]


def test_bad_words_multi_token_bans_only_after_the_prefix():
    proc = L.NoBadWordsLogitsProcessor([[4, 5]])
    out = proc(torch.tensor([[1, 4], [4, 1]]), torch.zeros(2, 8))
    assert torch.isinf(out[0, 5]) and not torch.isinf(out[1]).any() and torch.isinf(out).sum() == 1


def test_eos_only_bad_word_is_dropped():
    out = L.NoBadWordsLogitsProcessor([[2], [6]], eos_token_id=[2])(torch.tensor([[0]]), torch.zeros(1, 8))
    assert torch.isinf(out).nonzero()[:, 1].tolist() == [6]


def test_bad_words_beyond_the_lm_head_are_refused_as_in_transformers():
    import transformers

    for bad in ([[100]], [[3], [1, 200]], [[8]]):
        with pytest.raises(ValueError, match=r"vocabulary size is 8"):
            transformers.NoBadWordsLogitsProcessor(bad)(torch.tensor([[1]]), torch.zeros(1, 8))
        with pytest.raises(ValueError, match=r"bad_words_ids bans token ids \[\d+\].*8 columns \(ids 0-7\)"):
            L.NoBadWordsLogitsProcessor(bad)(torch.tensor([[1]]), torch.zeros(1, 8))
    out = L.NoBadWordsLogitsProcessor([[7], [1, 2]], eos_token_id=9)(torch.tensor([[1]]), torch.zeros(1, 8))
    assert torch.isinf(out).nonzero()[:, 1].tolist() == [2, 7]  # the largest id that fits is fine


def test_processors_follow_the_device_and_dtype_of_scores():
    scores = _scores().to(torch.bfloat16)
    for name, make_ours, *_ in CASES:
        out = make_ours()(_ids(), scores)
        assert out.dtype == torch.bfloat16 and out.shape == scores.shape, name


def test_constructor_errors_name_the_setting():
    with pytest.raises(ValueError, match="temperature"):
        L.TemperatureLogitsWarper(0.0)
    with pytest.raises(ValueError, match="top_p"):
        L.TopPLogitsWarper(1.5)
    with pytest.raises(ValueError, match="top_k"):
        L.TopKLogitsWarper(0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        L.RepetitionPenaltyLogitsProcessor(-1.0)
    with pytest.raises(ValueError, match="bad_words_ids"):
        L.NoBadWordsLogitsProcessor([])
    with pytest.raises(ValueError, match="top_h"):
        L.TopHLogitsWarper(0.0)
    with pytest.raises(ValueError, match="sequence_bias"):
        L.SequenceBiasLogitsProcessor([[3, -1.0]])
    with pytest.raises(ValueError, match="exponential_decay_length_penalty"):
        L.ExponentialDecayLengthPenalty((2, 1.5), None, 10)


# --- the whole list --------------------------------------------------------------------------------------------------

LIST_CONFIGS = [
    dict(),
    dict(do_sample=True),
    dict(do_sample=True, temperature=0.7, top_k=10, top_p=0.9, min_p=0.05),
    dict(do_sample=True, top_k=0, typical_p=0.8, epsilon_cutoff=0.01, eta_cutoff=0.02, renormalize_logits=True),
    dict(repetition_penalty=1.2, no_repeat_ngram_size=2, bad_words_ids=[[5], [1, 2]], min_new_tokens=3),
    dict(min_length=14, eos_token_id=[3, 8], suppress_tokens=[9], begin_suppress_tokens=[4], forced_eos_token_id=3,
         max_new_tokens=5),
    dict(num_beams=3, do_sample=True, top_k=2, top_p=0.5, length_penalty=0.8, remove_invalid_values=True),
    dict(do_sample=True, temperature=0.8, top_h=0.6, top_k=20, sequence_bias=[[[1, 2], -2.0], [[4], 3.5]],
         exponential_decay_length_penalty=(2, 1.3), remove_invalid_values=True, suppress_tokens=[9]),
]


def _transformers_list(kwargs: dict, prompt_length: int, attention_mask: torch.Tensor):
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers.generation.utils import GenerationMixin as HFGenerationMixin

    hf = HFGenerationConfig(**kwargs)
    hf.update(**HFGenerationConfig._get_default_generation_params(), defaults_only=True)
    # what generate() does to the lengths and special tokens before it builds the list
    hf.max_length = prompt_length + hf.max_new_tokens if hf.max_new_tokens else hf.max_length + prompt_length
    if hf.min_new_tokens is not None:
        hf.min_length = prompt_length + hf.min_new_tokens
    eos = kwargs.get("eos_token_id", 3)
    hf._eos_token_tensor = torch.tensor([eos] if isinstance(eos, int) else eos)
    model = SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=False),
                            _merge_criteria_processor_list=lambda default, custom: default)
    return HFGenerationMixin._get_logits_processor(model, hf, input_ids_seq_length=prompt_length, device="cpu",
                                                   model_kwargs={"attention_mask": attention_mask})


@pytest.mark.parametrize("kwargs", LIST_CONFIGS, ids=[",".join(sorted(c)) or "defaults" for c in LIST_CONFIGS])
def test_built_list_equals_transformers(kwargs):
    prompt_length = 10
    mask = torch.ones(BATCH, prompt_length, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row: its pad tokens are not penalised
    ours_config = GenerationConfig(**{"eos_token_id": 3, **kwargs})
    ours = L.build_logits_processors(ours_config, prompt_length, attention_mask=mask)
    theirs = _transformers_list(kwargs, prompt_length, mask)
    assert [type(p).__name__ for p in ours] == [type(p).__name__ for p in theirs]
    # run both over a few decode steps (the length-dependent processors switch on and off)
    for step, seq in enumerate(range(prompt_length, prompt_length + 6)):
        ids, scores = _ids(step, seq=seq), _scores(step)
        _assert_same(ours(ids, scores), theirs(ids, scores.clone()))


def test_greedy_defaults_build_an_empty_list():
    assert len(L.build_logits_processors(GenerationConfig(), 5)) == 0
    assert len(L.build_logits_processors(GenerationConfig(eos_token_id=2), 5)) == 0  # min_length 0: nothing
