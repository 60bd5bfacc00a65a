"""Prompt logprobs in the continuous batching engine (SamplingParams.prompt_logprobs): each prompt token's logprob
given the tokens before it, and its top alternatives, must equal a plain full forward of the model on the prompt,
whatever the chunked prefill, prefix sharing or preemption did to the way the prompt was computed; requests that
did not ask must not pay for prompt logits."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.sequence import RequestStatus, SamplingParams
from tests.engine.test_engine import greedy_reference, make_prompts, tiny_model

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def full_forward_log_probs(model, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), vocab): row i is the distribution of token i + 1 given tokens 0..i."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(model, prompt: list[int], output, k: int) -> None:
    assert output.status is RequestStatus.FINISHED, output.error
    assert len(output.prompt_logprobs) == len(prompt)  # one per token: no gap, no duplicate
    assert output.prompt_logprobs[0] is None
    log_probs = full_forward_log_probs(model, prompt)
    expected = log_probs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    torch.testing.assert_close(torch.tensor(output.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)
    if not k:
        assert output.prompt_top_logprobs == []
        return
    assert len(output.prompt_top_logprobs) == len(prompt) and output.prompt_top_logprobs[0] is None
    values, ids = log_probs[:-1].topk(k, dim=-1)
    for position, top in enumerate(output.prompt_top_logprobs[1:]):
        assert [t for t, _ in top] == ids[position].tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values[position], atol=1e-4, rtol=0)


@pytest.mark.parametrize("max_batch_tokens", [5, 512], ids=["chunks_of_5", "whole_prompts"])
def test_prompt_logprobs_equal_a_full_forward(model, max_batch_tokens):
    prompts = [p for p in make_prompts(12, seed=3)] + [[7]]  # a one-token prompt has only its None
    assert max(map(len, prompts)) > 4 * max_batch_tokens or max_batch_tokens == 512
    config = ContinuousBatchingConfig(block_size=8, num_blocks=64, max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    asked = {i: i % 3 for i in range(0, len(prompts), 2)}  # every other request, top-k of 0, 2 or 1
    ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS, prompt_logprobs=asked.get(i))
           for i, p in enumerate(prompts)]
    manager.run_until_done()
    outputs = [manager.get_result(r, timeout=0) for r in ids]
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        if i in asked:
            check_prompt_logprobs(model, prompt, output, asked[i])
        else:
            assert output.prompt_logprobs == [] and output.prompt_top_logprobs == []
    # Asking for prompt logprobs does not change the generated tokens.
    assert [o.generated_tokens for o in outputs] == greedy_reference(model, prompts, NEW_TOKENS)


def test_only_requests_that_ask_pay_for_prompt_logits(model):
    """The LM head sees one row per sampling sequence, plus the prompt rows of the requests that asked."""
    prompts = make_prompts(6, seed=4)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64, max_batch_tokens=512)
    rows = []
    compute_logits = manager.runner.compute_logits
    manager.runner.compute_logits = lambda hidden: (rows.append(hidden.shape[0]), compute_logits(hidden))[1]
    for p in prompts:
        manager.add_request(p, max_new_tokens=1)
    manager.run_until_done()
    assert sum(rows) == len(prompts)  # the last prompt position of each request, nothing else
    rows.clear()
    manager.add_request(prompts[0], max_new_tokens=1, prompt_logprobs=0)
    manager.add_request(prompts[1], max_new_tokens=1)
    manager.run_until_done()
    assert sum(rows) == 2 + len(prompts[0]) - 1


def test_shared_prefix_does_not_skip_wanted_positions(model):
    """A request asking for prompt logprobs takes no prefix hits (a cached block has no logits), its own blocks
    are still shared with later requests, and two requests sharing a head both get every position."""
    g = torch.Generator().manual_seed(5)
    head = torch.randint(0, 128, (24,), generator=g).tolist()
    first, second, third = (head + torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 3))
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64, max_batch_tokens=16)
    plain = manager.add_request(first, max_new_tokens=NEW_TOKENS)
    manager.run_until_done()
    hits = manager.prefix_hits
    asking = manager.add_request(second, max_new_tokens=NEW_TOKENS, prompt_logprobs=2)
    manager.run_until_done()
    assert manager.prefix_hits == hits  # the 24-token head was cached, but not taken
    check_prompt_logprobs(model, second, manager.get_result(asking, timeout=0), 2)
    later = manager.add_request(third, max_new_tokens=NEW_TOKENS)
    manager.run_until_done()
    assert manager.prefix_hits == hits + 3  # the other requests still share the head
    assert manager.get_result(plain, timeout=0).generated_tokens == greedy_reference(model, [first], NEW_TOKENS)[0]
    assert manager.get_result(later, timeout=0).generated_tokens == greedy_reference(model, [third], NEW_TOKENS)[0]
    both = [manager.add_request(p, max_new_tokens=NEW_TOKENS, prompt_logprobs=1) for p in (first, third)]
    manager.run_until_done()
    for prompt, rid in zip((first, third), both):
        check_prompt_logprobs(model, prompt, manager.get_result(rid, timeout=0), 1)


def test_preemption_and_recompute_never_duplicate_entries(model):
    """A cache far too small for the load preempts requests in the middle of their prefill and after it; each
    request still ends with exactly one logprob per prompt token, equal to the full forward's."""
    prompts = make_prompts(24, seed=6)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=18, max_batch_tokens=8, max_requests_per_batch=8)
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    recorded_at_preemption = []  # (prompt logprobs recorded, prompt length) of each preempted asking request
    preempt = manager.scheduler._preempt

    def watched_preempt(seq, batch, budget):
        if seq.params.prompt_logprobs is not None:
            recorded_at_preemption.append((len(seq.prompt_logprobs), len(seq.prompt_ids)))
        preempt(seq, batch, budget)

    manager.scheduler._preempt = watched_preempt
    ids, pending = [], list(enumerate(prompts))
    while pending or manager.step():
        for i, prompt in pending[:3]:
            ids.append(manager.add_request(prompt, max_new_tokens=8, prompt_logprobs=2 if i % 2 else None))
        pending = pending[3:]
    assert any(done < length for done, length in recorded_at_preemption), "no preemption in the middle of a prefill"
    assert any(done == length for done, length in recorded_at_preemption), "no preemption after a prefill"
    outputs = [manager.get_result(r, timeout=0) for r in ids]
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        if i % 2:
            check_prompt_logprobs(model, prompt, output, 2)
        else:
            assert output.prompt_logprobs == []
    assert [o.generated_tokens for o in outputs] == greedy_reference(model, prompts, 8)
    assert manager.block_manager.num_free_blocks == config.num_blocks


def test_streamed_outputs_carry_the_prompt_logprobs(model):
    prompt = make_prompts(3, seed=7)[2]
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    with manager:
        rid = manager.add_request(prompt, max_new_tokens=3, streaming=True, prompt_logprobs=0)
        updates = list(manager.request_id_iter(rid))
    assert len(updates) == 3 and all(len(u.prompt_logprobs) == len(prompt) for u in updates)
    check_prompt_logprobs(model, prompt, updates[-1], 0)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_bad_prompt_logprobs_are_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=f"prompt_logprobs={value!r} must be None"):
        SamplingParams(prompt_logprobs=value)
