"""sequence_bias, exponential_decay_length_penalty, top_h and prefill_chunk_size against transformers: the processors
on the same scores (edge cases beyond tests/test_logits.py), generate()'s tokens on a tiny random checkpoint, the
config checks, and that chunked prefill really runs in chunks and gives the tokens of an unchunked one.

transformers is imported inside tests and fixtures (it costs seconds).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gpuformers.generation import logits as L
from gpuformers.generation.cache import StaticCache
from gpuformers.generation.config import GenerationConfig
from tests.fixtures.checkpoints import make_checkpoint

PROMPT_LENGTH, PAD, EOS = 10, 4, 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, our model) loaded from one tiny random llama checkpoint (vocab 128, eos 2, pad 0)."""
    import transformers

    from gpuformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("extras")
    make_checkpoint(folder, "llama", bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, progress=False)


def _prompt():
    """(2, PROMPT_LENGTH) ids, the second row left-padded by PAD tokens, and the mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, PROMPT_LENGTH), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :PAD], mask[1, :PAD] = 0, 0
    return ids, mask


def _both(models, ids, seed=None, **settings):
    """transformers' and our generate() on the same prompt and settings (the same seed before each, if given)."""
    hf, ours = models
    outs = []
    for model in (hf, ours):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(model.generate(ids, **settings))
    return outs


# --- the processors on the same scores -------------------------------------------------------------------------------


def _scores(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, vocab, generator=g) * 3
    scores[0, :5] = -float("inf")  # tokens a constraint already removed
    return scores


@pytest.mark.parametrize("vocab", [40, 300])  # below and above the 100 candidates Top-H considers
@pytest.mark.parametrize("top_h", [0.1, 0.4, 0.9, 1.0])
def test_top_h_matches_transformers(vocab, top_h):
    from transformers.generation.logits_process import TopHLogitsWarper

    scores, ids = _scores(vocab), torch.zeros(4, 3, dtype=torch.long)
    ours = L.TopHLogitsWarper(top_h)(ids, scores)
    theirs = TopHLogitsWarper(top_h)(ids, scores.clone())
    assert torch.equal(ours, theirs)
    kept = (~torch.isinf(ours)).sum(-1)
    assert (kept >= 1).all() and (kept <= min(vocab, 100)).all()
    if top_h < 1.0:
        assert (kept < (~torch.isinf(scores)).sum(-1)).all()  # it removed something in every row


@pytest.mark.parametrize("as_dict", [False, True])
def test_sequence_bias_matches_transformers_and_sums_shared_last_tokens(as_dict):
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    # [1, 5] and [0, 2, 5] end in the same token: in a row ending with 0, 2 both apply and add up
    pairs = [[[1, 5], -2.0], [[4], 3.5], [[0, 2, 5], 1.25], [[2], -float("inf")], [[7, 9], 4]]
    bias = {tuple(ids): float(b) for ids, b in pairs} if as_dict else pairs
    ids = torch.tensor([[3, 3, 1], [3, 0, 2], [7, 7, 7], [5, 5, 5]])
    scores = _scores(12)
    ours = L.SequenceBiasLogitsProcessor(bias)(ids, scores)
    hf_bias = {tuple(i): float(b) for i, b in pairs} if as_dict else [[i, float(b)] for i, b in pairs]
    assert torch.equal(ours, SequenceBiasLogitsProcessor(hf_bias)(ids, scores.clone()))
    assert ours[0, 5] == scores[0, 5] - 2.0 and ours[1, 5] == scores[1, 5] + 1.25 and ours[2, 9] == scores[2, 9] + 4
    assert torch.isinf(ours[:, 2]).all() and torch.equal(ours[3, 5:], scores[3, 5:])


def test_sequence_bias_out_of_vocab_is_refused_like_transformers():
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    ids, scores = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 8)
    with pytest.raises(ValueError):
        SequenceBiasLogitsProcessor([[[1, 8], -1.0]])(ids, scores)
    with pytest.raises(ValueError, match=r"sequence_bias biases token ids \[8\].*8 columns"):
        L.SequenceBiasLogitsProcessor([[[1, 8], -1.0]])(ids, scores)


def test_exponential_decay_matches_transformers_on_negative_and_infinite_eos_scores():
    from transformers.generation.logits_process import ExponentialDecayLengthPenalty

    scores = _scores(12)
    scores[0, 3], scores[1, 3], scores[2, 8] = -4.0, -float("inf"), float("inf")
    for length in (12, 13, 14, 20):  # the penalty starts after prompt (10) + start_index (2)
        ids = torch.zeros(4, length, dtype=torch.long)
        ours = L.ExponentialDecayLengthPenalty((2, 1.7), [3, 8, 3], 10)(ids, scores)
        theirs = ExponentialDecayLengthPenalty((2, 1.7), [3, 8], 10)(ids, scores.clone())
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ours[:, [0, 1, 2, 4, 5, 6, 7, 9, 10, 11]], scores[:, [0, 1, 2, 4, 5, 6, 7, 9, 10, 11]])
        if length > 12:
            assert ours[0, 3] > scores[0, 3]  # a negative eos score rises too


# --- generate() against transformers -------------------------------------------------------------------------------


def test_sequence_bias_changes_greedy_tokens_as_transformers(models):
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    plain = models[1].generate(ids, **settings)
    # ban the first greedy token of row 0; favour a token after the prompt's last token (a 2-token sequence)
    bias = [[[int(plain[0, PROMPT_LENGTH])], -20.0], [[int(ids[1, -1]), 5], 8.0]]
    expected, got = _both(models, ids, sequence_bias=bias, **settings)
    assert torch.equal(got, expected)
    assert got[0, PROMPT_LENGTH] != plain[0, PROMPT_LENGTH] and got[1, PROMPT_LENGTH] == 5
    dict_form = models[1].generate(ids, sequence_bias={tuple(i): b for i, b in bias}, **settings)
    assert torch.equal(dict_form, got)


def test_exponential_decay_ends_generation_early_as_transformers(models):
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, exponential_decay_length_penalty=(3, 2.0))
    expected, got = _both(models, ids, **settings)
    assert torch.equal(got, expected)
    assert (got[:, PROMPT_LENGTH:] == EOS).any(dim=1).all() and got.shape[1] < PROMPT_LENGTH + 16
    plain = models[1].generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert not (plain[:, PROMPT_LENGTH:] == EOS).any()  # without the penalty nobody stops


@pytest.mark.parametrize("top_h", [0.3, 0.8])
def test_top_h_sampling_matches_transformers(models, top_h):
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, top_h=top_h, num_return_sequences=2)
    expected, got = _both(models, ids, seed=3, **settings)
    assert torch.equal(got, expected)
    torch.manual_seed(3)
    unfiltered = models[1].generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=0,
                                    num_return_sequences=2)
    assert not torch.equal(got, unfiltered)


# --- prefill_chunk_size ----------------------------------------------------------------------------------------------


def _forward_lengths(model):
    """A list that records the number of tokens of each forward of `model`, and the hook's handle."""
    lengths = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    return lengths, handle


@pytest.mark.parametrize("chunk, forwards", [(3, [3, 3, 3, 1]), (4, [4, 4, 2]), (10, [10]), (16, [10])])
def test_prefill_chunk_size_matches_transformers_and_runs_in_chunks(models, chunk, forwards):
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    unchunked = models[1].generate(ids, **settings)
    lengths, handle = _forward_lengths(models[1])
    try:
        expected, got = _both(models, ids, prefill_chunk_size=chunk, **settings)
    finally:
        handle.remove()
    assert torch.equal(got, expected) and torch.equal(got, unchunked)
    assert lengths == forwards + [1] * 11  # the chunks, then one token per decode step


def test_prefill_chunks_with_beams_sampling_and_static_cache_give_unchunked_tokens(models):
    ids, mask = _prompt()
    beams = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
    expected, got = _both(models, ids, prefill_chunk_size=4, **beams)
    assert torch.equal(got, expected) and torch.equal(got, models[1].generate(ids, **beams))
    sampled = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=10)
    expected, got = _both(models, ids, seed=5, prefill_chunk_size=3, **sampled)
    assert torch.equal(got, expected)
    greedy = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8)
    fixed = StaticCache(models[1].config, max_cache_len=PROMPT_LENGTH + 8)  # fixed shapes: attends over all slots
    chunked = models[1].generate(ids, past_key_values=fixed, prefill_chunk_size=4, **greedy)
    assert torch.equal(chunked, models[1].generate(ids, **greedy))


def test_prefill_chunk_size_without_a_cache_is_refused_like_transformers(models):
    ids, mask = _prompt()
    for model in models:
        with pytest.raises(ValueError, match="(?i)prefill.chunk"):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, use_cache=False, prefill_chunk_size=4)


# --- the config ----------------------------------------------------------------------------------------------------


def test_fields_are_supported_now_no_warning_and_json_round_trip(tmp_path):
    from transformers import GenerationConfig as HFGenerationConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gc = GenerationConfig(top_h=0.4, sequence_bias={(1, 2): -2.0, (5,): 1.5},
                              exponential_decay_length_penalty=(15, 1.6), prefill_chunk_size=512)
    gc.save_pretrained(tmp_path)
    theirs = HFGenerationConfig.from_pretrained(tmp_path)
    assert theirs.sequence_bias == [[[1, 2], -2.0], [[5], 1.5]] and theirs.top_h == 0.4
    assert list(theirs.exponential_decay_length_penalty) == [15, 1.6] and theirs.prefill_chunk_size == 512
    back = GenerationConfig.from_pretrained(tmp_path)
    assert back == gc and back.exponential_decay_length_penalty == (15, 1.6)


@pytest.mark.parametrize("field, value", [
    ("top_h", 0.0), ("top_h", 1.5), ("top_h", "0.5"),
    ("sequence_bias", []), ("sequence_bias", [[3, -1.0]]), ("sequence_bias", {3: -1.0}),
    ("sequence_bias", [[[1, -2], -1.0]]), ("sequence_bias", [[[1], "high"]]),
    ("exponential_decay_length_penalty", 15), ("exponential_decay_length_penalty", (15,)),
    ("exponential_decay_length_penalty", (1.5, 15)),
    ("prefill_chunk_size", 0), ("prefill_chunk_size", 2.5),
])
def test_bad_values_raise_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"generation config field {field}"):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize("value", [[], [[3, -1.0]], {3: -1.0}, [[[1, -2], -1.0]], [[[1], "high"]]])
def test_sequence_bias_forms_transformers_refuses_are_refused(value):
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    with pytest.raises(ValueError):
        SequenceBiasLogitsProcessor(value)
    with pytest.raises(ValueError, match="sequence_bias"):
        L.SequenceBiasLogitsProcessor(value)


def test_exponential_decay_without_eos_is_a_clear_error():
    with pytest.raises(ValueError, match="exponential_decay_length_penalty.*no eos_token_id"):
        L.build_logits_processors(GenerationConfig(exponential_decay_length_penalty=(2, 1.5)), 5)
