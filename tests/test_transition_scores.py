"""compute_transition_scores against transformers' on the same tiny random weights: greedy, sampling and beam search,
with raw and normalised scores; beam search's identity sum(transition scores) == sequences_scores; edge cases.

transformers is imported inside the fixture (it costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from gpuformers.generation.transition_scores import compute_transition_scores
from tests.test_generate import _pair, _prompt

PROMPT_LENGTH = 10
OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


@pytest.fixture(scope="module")
def models():
    return _pair("llama")


def _assert_close(got: torch.Tensor, expected: torch.Tensor):
    """Equal within 1e-4; -inf (a token a processor had removed, e.g. padding after eos) only where expected."""
    expected = expected.to(got.dtype)
    assert got.shape == expected.shape
    finite = torch.isfinite(expected)
    assert torch.equal(got[~finite], expected[~finite])
    assert (got[finite] - expected[finite]).abs().max() < 1e-4


@pytest.mark.parametrize("normalize", [False, True])
def test_greedy_matches_transformers(models, normalize):
    hf, ours = models
    ids, mask = _prompt()
    # eos 46 ends a row early (then padded), repetition_penalty makes the processed scores differ from the logits
    settings = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=[2, 46], repetition_penalty=1.3, **OUTPUTS)
    expected = hf.generate(ids, do_sample=False, **settings)
    got = ours.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    for field in ("scores", "logits"):
        want = hf.compute_transition_scores(expected.sequences, getattr(expected, field),
                                            normalize_logits=normalize)
        have = ours.compute_transition_scores(got.sequences, getattr(got, field), normalize_logits=normalize)
        assert have.shape == (2, got.sequences.shape[1] - PROMPT_LENGTH)
        _assert_close(have, want)
    # greedy picks each step's best processed score, so that is every token's transition score
    best = torch.stack(got.scores, dim=1).amax(-1)
    if normalize:
        best = best - torch.stack(got.scores, dim=1).logsumexp(-1)
    is_eos = torch.isin(got.sequences[:, PROMPT_LENGTH:], torch.tensor([2, 46]))
    unfinished = (is_eos.cumsum(-1) - is_eos.long()) == 0  # up to each row's eos; after it come pad tokens
    assert not unfinished.all()  # a row did end early
    _assert_close(ours.compute_transition_scores(got.sequences, got.scores, normalize_logits=normalize)[unfinished],
                  best[unfinished])


@pytest.mark.parametrize("normalize", [False, True])
def test_sampling_matches_transformers_on_the_same_outputs(models, normalize):
    hf, ours = models
    ids, mask = _prompt()
    # min_new_tokens: no row ends early, so every token was sampled (none is padding)
    settings = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=True, temperature=0.7,
                    top_k=20, num_return_sequences=2, **OUTPUTS)
    torch.manual_seed(7)
    got = ours.generate(ids, **settings)
    torch.manual_seed(7)
    expected = hf.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)  # seeded: the same draws on the CPU
    for field in ("scores", "logits"):
        scores = getattr(got, field)
        have = ours.compute_transition_scores(got.sequences, scores, normalize_logits=normalize)
        _assert_close(have, hf.compute_transition_scores(got.sequences, scores, normalize_logits=normalize))
        _assert_close(have, hf.compute_transition_scores(expected.sequences, getattr(expected, field),
                                                         normalize_logits=normalize))
    # sampled tokens were allowed by top_k: finite scores, and log-probabilities (<= 0) once normalised
    have = ours.compute_transition_scores(got.sequences, got.scores, normalize_logits=True)
    assert torch.isfinite(have).all() and (have <= 0).all()


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
@pytest.mark.parametrize("normalize", [False, True])
def test_beam_search_matches_transformers(models, length_penalty, normalize):
    hf, ours = models
    ids, mask = _prompt()
    # eos 46/80 end beams at different lengths, so beam_indices holds -1 after them
    settings = dict(attention_mask=mask, max_new_tokens=16, num_beams=4, num_return_sequences=2,
                    length_penalty=length_penalty, eos_token_id=[46, 80], **OUTPUTS)
    expected = hf.generate(ids, do_sample=False, **settings)
    got = ours.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    assert torch.equal(got.beam_indices, expected.beam_indices.long())
    for field in ("scores", "logits"):
        want = hf.compute_transition_scores(expected.sequences, getattr(expected, field), expected.beam_indices,
                                            normalize_logits=normalize)
        have = ours.compute_transition_scores(got.sequences, getattr(got, field), got.beam_indices,
                                              normalize_logits=normalize)
        _assert_close(have, want)


@pytest.mark.parametrize("eos", [[46, 80], None])
def test_beam_search_scores_add_up_to_sequences_scores(models, eos):
    hf, ours = models
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=16, num_beams=4, num_return_sequences=4, **OUTPUTS)
    if eos is not None:
        settings["eos_token_id"] = eos
    out = ours.generate(ids, length_penalty=0.0, **settings)
    transition = ours.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    _assert_close(transition.sum(-1), out.sequences_scores)
    if eos is not None:
        lengths = (out.beam_indices >= 0).sum(-1)
        assert lengths.min() < lengths.max()  # rows that ended early (zeros past their end) were exercised
    # with a length penalty the sum is divided by each sequence's own generated length
    out = ours.generate(ids, length_penalty=1.0, **settings)
    transition = ours.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    lengths = (out.beam_indices >= 0).sum(-1)
    _assert_close(transition.sum(-1) / lengths, out.sequences_scores)


def test_hand_made_beam_indices():
    # two steps over a vocab of 3, rows 0 and 1; output row 1 ended after one token (beam index -1, token -1)
    scores = (torch.tensor([[0.1, 0.2, 0.3], [1.1, 1.2, 1.3]]), torch.tensor([[2.1, 2.2, 2.3], [3.1, 3.2, 3.3]]))
    sequences = torch.tensor([[9, 2, 0], [9, 1, -1]])
    beam_indices = torch.tensor([[1, 0], [0, -1]])
    got = compute_transition_scores(sequences, scores, beam_indices)
    assert torch.allclose(got, torch.tensor([[1.3, 2.1], [0.2, 0.0]]))
    normalised = compute_transition_scores(sequences, scores, beam_indices, normalize_logits=True)
    assert torch.allclose(normalised[0, 0], scores[0].log_softmax(-1)[1, 2])
    # without beam_indices, output row r reads row r at every step
    assert torch.allclose(compute_transition_scores(sequences[:, :2].clone().fill_(1), scores[:1]),
                          torch.tensor([[0.2], [1.2]]))


def test_errors_say_what_to_pass(models):
    _, ours = models
    ids, mask = _prompt()
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=4, num_return_sequences=2, **OUTPUTS)
    with pytest.raises(ValueError, match="beam_indices"):
        ours.compute_transition_scores(out.sequences, out.scores)  # 4 output rows, 8 beam rows, no beam_indices
    with pytest.raises(ValueError, match="output_scores"):
        ours.compute_transition_scores(out.sequences, ())
    with pytest.raises(ValueError, match="same generate"):
        ours.compute_transition_scores(out.sequences, out.scores[:2], out.beam_indices)
