"""generate() against transformers' on a tiny random checkpoint, for the differences a differential fuzzer found:
the caller's logits processors and stopping criteria placed (and replacing built ones) as in transformers, the
positions after a right-padded prompt, a forced token that is also suppressed, None fields of a passed
GenerationConfig, and "hybrid" given as cache_implementation.

transformers is imported inside fixtures and tests (it costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import make_checkpoint

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, our model) of one tiny random Llama checkpoint, logits spread out so that greedy picks
    are not decided by float noise."""
    from gpuformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    hf = make_checkpoint(folder, "llama", **IDS)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
    hf.save_pretrained(folder)
    return hf, AutoModelForCausalLM.from_pretrained(folder, progress=False).eval()


def _generate(model, ids, seed=0, **kwargs):
    torch.manual_seed(seed)
    return model.generate(ids, **kwargs)


def _assert_same(got, expected):
    """Same tokens, and the same scores (finite ones within 1e-4, the same -inf pattern) at every step."""
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    for ours, theirs in zip(got.scores, expected.scores):
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        finite = torch.isfinite(theirs)
        torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-4, rtol=0)


def test_custom_logits_processor_runs_before_the_sampling_warpers(pair):
    """A caller's processor that raises a token outside the top 5 makes it the only candidate, as in transformers
    (it runs before top_k); run after the warpers it found the token already at -inf."""
    import transformers

    from gpuformers.generation.logits import LogitsProcessor

    hf, ours = pair
    ids = torch.tensor([[5, 9, 23, 42]])

    def boost(scores):
        scores = scores.clone()
        scores[:, 7] += 100.0
        return scores

    class HFBoost(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return boost(scores)

    class OurBoost(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return boost(scores)

    kwargs = dict(do_sample=True, top_k=5, renormalize_logits=True, max_new_tokens=4, return_dict_in_generate=True,
                  output_scores=True)
    expected = _generate(hf, ids, logits_processor=transformers.LogitsProcessorList([HFBoost()]), **kwargs)
    got = _generate(ours, ids, logits_processor=[OurBoost()], **kwargs)
    assert expected.sequences[0, 4:].tolist() == [7, 7, 7, 7]
    _assert_same(got, expected)


def test_custom_processor_of_a_built_class_replaces_it(pair):
    """transformers uses the caller's RepetitionPenaltyLogitsProcessor instead of the one repetition_penalty builds,
    in its place; both applied, the penalty compounded."""
    import transformers

    from gpuformers.generation.logits import RepetitionPenaltyLogitsProcessor

    hf, ours = pair
    ids = torch.tensor([[5, 9, 23, 42, 9, 9]])
    kwargs = dict(repetition_penalty=1.3, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_scores=True)
    expected = _generate(hf, ids, logits_processor=transformers.LogitsProcessorList(
        [transformers.RepetitionPenaltyLogitsProcessor(4.0)]), **kwargs)
    got = _generate(ours, ids, logits_processor=[RepetitionPenaltyLogitsProcessor(4.0)], **kwargs)
    _assert_same(got, expected)


def test_custom_eos_criteria_replace_the_built_one(pair):
    """A caller's EosTokenCriteria replaces the one eos_token_id builds: rows end on the caller's token only."""
    import transformers

    from gpuformers.generation.stopping import EosTokenCriteria

    hf, ours = pair
    ids = torch.tensor([[5, 9, 23, 42]])
    first = hf.generate(ids, max_new_tokens=1, do_sample=False)[0, -1].item()
    kwargs = dict(eos_token_id=first, max_new_tokens=6, do_sample=False)
    expected = hf.generate(ids, stopping_criteria=transformers.StoppingCriteriaList(
        [transformers.generation.EosTokenCriteria(eos_token_id=127)]), **kwargs)
    got = ours.generate(ids, stopping_criteria=[EosTokenCriteria(127)], **kwargs)
    assert expected.shape[1] > ids.shape[1] + 1  # the built eos criterion would have stopped after one token
    assert torch.equal(got, expected)


def test_positions_after_a_right_padded_prompt_follow_transformers(pair):
    """transformers gives padding position 0 and each new token the prompt's last position + 1, so after a
    right-padded prompt the first logits come from a query at position 0 and generation restarts at 1."""
    hf, ours = pair
    ids = torch.tensor([[5, 9, 23, 42, 7, 8], [11, 12, 13, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                  output_scores=True)
    _assert_same(_generate(ours, ids, **kwargs), _generate(hf, ids, **kwargs))


@pytest.mark.parametrize("forced", [dict(forced_eos_token_id=9), dict(forced_bos_token_id=9)])
def test_a_forced_token_that_is_also_suppressed_is_refused(pair, forced):
    """transformers refuses it with a ValueError (sampling would fail on an all -inf row); so do we, before
    generating, naming both fields."""
    hf, ours = pair
    ids = torch.tensor([[5]])
    kwargs = dict(suppress_tokens=[9, 10], max_new_tokens=3, do_sample=True, **forced)
    with pytest.raises(ValueError, match="suppress_tokens"):
        hf.generate(ids, **kwargs)
    with pytest.raises(ValueError, match=f"{next(iter(forced))}.*suppress_tokens"):
        ours.generate(ids, **kwargs)


def test_none_in_a_passed_generation_config_keeps_the_model_value(pair):
    """transformers fills the None fields of a passed GenerationConfig from model.generation_config, so
    GenerationConfig(eos_token_id=None) keeps the model's eos and generation stops there."""
    import transformers

    from gpuformers.generation.config import GenerationConfig

    hf, ours = pair
    ids = torch.tensor([[5, 9, 23, 42]])
    second = hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)[0, -1].item()
    saved = hf.generation_config.eos_token_id, ours.generation_config.eos_token_id
    hf.generation_config.eos_token_id = ours.generation_config.eos_token_id = second
    try:
        expected = hf.generate(ids, generation_config=transformers.GenerationConfig(
            eos_token_id=None, max_new_tokens=8, do_sample=False))
        got = ours.generate(ids, generation_config=GenerationConfig(eos_token_id=None, max_new_tokens=8))
    finally:
        hf.generation_config.eos_token_id, ours.generation_config.eos_token_id = saved
    assert expected.shape[1] == ids.shape[1] + 2  # stopped at the model's eos
    assert torch.equal(got, expected)


def test_hybrid_cache_implementation_is_the_default_cache(pair):
    """transformers reads cache_implementation="hybrid" as the default dynamic cache wherever it comes from,
    generate()'s kwargs included."""
    hf, ours = pair
    ids = torch.tensor([[5, 9, 23, 42]])
    kwargs = dict(cache_implementation="hybrid", max_new_tokens=4, do_sample=False)
    assert torch.equal(ours.generate(ids, **kwargs), hf.generate(ids, **kwargs))


def test_beam_sampling_refuses_more_sequences_than_beams(pair):
    """num_return_sequences > num_beams is refused with do_sample=True too (transformers' ValueError); it used to
    fail deep in beam search with a shape error."""
    hf, ours = pair
    kwargs = dict(num_beams=2, num_return_sequences=3, do_sample=True, max_new_tokens=3)
    with pytest.raises(ValueError, match="num_return_sequences"):
        hf.generate(torch.tensor([[5, 9]]), **kwargs)
    with pytest.raises(ValueError, match=r"num_return_sequences \(3\) must be <= num_beams \(2\)"):
        ours.generate(torch.tensor([[5, 9]]), **kwargs)


@pytest.mark.parametrize("stop_at", [6, 10])
def test_custom_max_length_criteria_decide_the_length(pair, stop_at):
    """A caller's MaxLengthCriteria replaces the built one in transformers, so it ends generation before or after
    max_new_tokens; it used to be ignored (the loop only checked criteria other than length ones)."""
    import transformers

    from gpuformers.generation.stopping import MaxLengthCriteria

    hf, ours = pair
    ids = torch.tensor([[5, 9, 23, 42]])
    kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    expected = hf.generate(ids, stopping_criteria=transformers.StoppingCriteriaList(
        [transformers.MaxLengthCriteria(max_length=stop_at)]), **kwargs)
    got = ours.generate(ids, stopping_criteria=[MaxLengthCriteria(stop_at)], **kwargs)
    assert expected.shape[1] == stop_at
    assert torch.equal(got, expected)


def test_beam_sampling_with_an_empty_eos_list_keeps_one_token(pair):
    """transformers keeps len(eos) + 1 tokens per warper in beam sampling, so with eos_token_id=[] top_k=1 keeps
    one token (only eos None falls back to 2); we kept 2, so the processed scores differed."""
    hf, ours = pair
    ids = torch.tensor([[5, 9, 23], [7, 64, 100]])
    kwargs = dict(num_beams=2, do_sample=True, top_k=1, eos_token_id=[], pad_token_id=5, max_new_tokens=3,
                  return_dict_in_generate=True, output_scores=True)
    _assert_same(_generate(ours, ids, **kwargs), _generate(hf, ids, **kwargs))


def test_generating_past_gpt2s_learned_positions_is_a_clear_error(tmp_path):
    """GPT-2 has no position embedding past n_positions: the step that got there raised a bare IndexError."""
    from gpuformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "gpt2", max_position_embeddings=16)  # GPT-2 reads it as n_positions
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, progress=False)
    ids = torch.arange(3, 13)[None]  # 10 tokens
    with pytest.raises(ValueError, match=r"needs 17 positions, but GPT2LMHeadModel has learned positions for 16 .* "
                                         r"at most 7 new tokens"):
        model.generate(ids, max_new_tokens=8, do_sample=False)
    assert model.generate(ids, max_new_tokens=7, do_sample=False).shape == (1, 17)  # the 17th token is never fed
