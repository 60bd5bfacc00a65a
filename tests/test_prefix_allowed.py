"""generate(prefix_allowed_tokens_fn=...) against transformers: the processor on the same scores, and the same tokens
with greedy search, beam search and sampling; every generated token is one the function allowed.

transformers is imported inside tests and fixtures (it costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from gpuformers.generation.prefix_constrained import PrefixConstrainedLogitsProcessor
from tests.test_generate import _pair, _prompt

PROMPT_LENGTH, EOS = 10, 2


@pytest.fixture(scope="module")
def models():
    return _pair("llama")


def allowed_tokens(batch_id: int, input_ids: torch.Tensor) -> list[int]:
    """Four tokens that depend on the prompt and the last token; never eos, so every row runs to the end."""
    base = (int(input_ids[-1]) * 7 + batch_id * 3) % 100
    return [base + 3, base + 11, (base * 5) % 120 + 3, (base + 50) % 120 + 4]


def _outside_allowed(sequences: torch.Tensor, rows_per_prompt: int) -> int:
    """How many generated tokens `allowed_tokens` did not allow, given the tokens before them."""
    count = 0
    for row, sequence in enumerate(sequences):
        for position in range(PROMPT_LENGTH, sequence.shape[0]):
            allowed = allowed_tokens(row // rows_per_prompt, sequence[:position])
            count += int(sequence[position]) not in allowed
    return count


def test_processor_matches_transformers():
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor as HFProcessor

    torch.manual_seed(0)
    input_ids = torch.randint(3, 128, (6, 5))  # 2 prompts x 3 beams
    scores = torch.randn(6, 128)
    # prompt 1: every allowed token is already -inf in all three beams, so the constraint alone is returned
    for row in (3, 4, 5):
        scores[row, allowed_tokens(1, input_ids[row])] = float("-inf")
    scores[0, allowed_tokens(0, input_ids[0])] = float("-inf")  # prompt 0 still has beams 1 and 2
    ours = PrefixConstrainedLogitsProcessor(allowed_tokens, num_beams=3)(input_ids, scores)
    expected = HFProcessor(allowed_tokens, num_beams=3)(input_ids, scores.clone())
    assert torch.equal(ours, expected)
    assert torch.isfinite(ours[3:]).sum() == 3 * 4 and (ours[3:][torch.isfinite(ours[3:])] == 0).all()


@pytest.mark.parametrize("beams", [1, 4])
def test_generate_matches_transformers_and_keeps_to_the_allowed_tokens(models, beams):
    hf, ours = models
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=12, num_beams=beams, num_return_sequences=min(beams, 2))
    expected = hf.generate(ids, do_sample=False, prefix_allowed_tokens_fn=allowed_tokens, **settings)
    got = ours.generate(ids, prefix_allowed_tokens_fn=allowed_tokens, **settings)
    assert torch.equal(got, expected)
    rows_per_prompt = settings["num_return_sequences"]
    assert got.shape == (2 * rows_per_prompt, PROMPT_LENGTH + 12)
    assert _outside_allowed(got, rows_per_prompt) == 0
    # the constraint did change something: unconstrained, the model picks tokens outside the allowed sets
    free = ours.generate(ids, **settings)
    assert _outside_allowed(free, rows_per_prompt) > 0


def test_sampling_several_per_prompt_matches_transformers(models):
    hf, ours = models
    ids, mask = _prompt()
    # three rows per prompt: batch_id must be row // num_return_sequences
    settings = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, num_return_sequences=3,
                    prefix_allowed_tokens_fn=allowed_tokens)
    torch.manual_seed(5)
    expected = hf.generate(ids, **settings)
    torch.manual_seed(5)
    got = ours.generate(ids, **settings)
    assert torch.equal(got, expected)
    assert _outside_allowed(got, 3) == 0


def test_constraint_wins_over_a_ban(models):
    hf, ours = models
    ids, mask = _prompt()

    def only_eos(batch_id, input_ids):
        return [EOS]

    # min_new_tokens bans eos, the only allowed token: both libraries force eos regardless
    settings = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, prefix_allowed_tokens_fn=only_eos)
    expected = hf.generate(ids, do_sample=False, **settings)
    got = ours.generate(ids, **settings)
    assert torch.equal(got, expected)
    assert (got[:, PROMPT_LENGTH] == EOS).all()


def test_errors_name_the_problem(models):
    _, ours = models
    ids, mask = _prompt()
    with pytest.raises(ValueError, match="returned no tokens for batch_id 0"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=3, prefix_allowed_tokens_fn=lambda b, x: [])
    with pytest.raises(ValueError, match=r"outside 0\.\.127.*\[500\]"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=3, prefix_allowed_tokens_fn=lambda b, x: [5, 500])
    with pytest.raises(TypeError, match="must be a function"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=3, prefix_allowed_tokens_fn=[1, 2])
