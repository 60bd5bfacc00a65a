"""Asynchronous batching (ContinuousBatchingConfig.use_async_batching): step N+1 is scheduled and launched before
step N's tokens reach the host. Forced on the CPU, it must give exactly what the synchronous engine gives: greedy
tokens equal to generate() for staggered requests under preemption and prefix sharing; requests ended early by eos
and stop sequences (whose lookahead sample is dropped); the same seeded samples and logprobs; prompt logprobs;
cancel and streaming; every block free at the end."""

from __future__ import annotations

import random

import pytest
import torch

from gpuformers.engine.block_manager import BlockManager
from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.scheduler import Scheduler
from gpuformers.engine.sequence import PLACEHOLDER, RequestStatus, SamplingParams, Sequence
from tests.engine.test_engine import (NEW_TOKENS, assert_matches_under_preemption, greedy_reference, make_prompts,
                                      run_staggered, tiny_model)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module")
def qwen3():
    model = tiny_model()
    prompts = make_prompts(40, seed=2)
    return model, prompts, greedy_reference(model, prompts)


def engine(model, async_batching: bool, eos_token_id=None, **config):
    settings = dict(block_size=8, num_blocks=64, max_batch_tokens=32, max_requests_per_batch=16)
    settings.update(config)
    cb_config = ContinuousBatchingConfig(use_async_batching=async_batching, **settings)
    manager = model.init_continuous_batching(continuous_batching_config=cb_config, eos_token_id=eos_token_id)
    assert manager.config.use_async_batching is async_batching
    return manager


def assert_all_free(manager):
    assert manager.block_manager.num_free_blocks == manager.config.num_blocks
    assert all(block.ref_count == 0 for block in manager.block_manager.blocks)
    assert not manager.scheduler.waiting and not manager.scheduler.running and manager._in_flight is None


def truncated(tokens: list[int], eos: int | None, stops: list[list[int]]) -> list[int]:
    """What a request generating `tokens` greedily keeps when eos and the stop sequences end it."""
    for end in range(1, len(tokens) + 1):
        head = tokens[:end]
        if head[-1] == eos or any(head[-len(s):] == s for s in stops):
            return head
    return tokens


# --- the scheduler alone, against a mock model whose tokens are chosen at launch --------------------------------


def position_token(seq: Sequence) -> int:
    """A mock model's token: it depends only on the request and how many tokens it has sampled so far (in flight
    included), so a mock step can choose it at launch, as the device does. Token 0 is eos; [3, 4] a stop sequence."""
    k = len(seq.generated_ids) + seq.num_pending_tokens
    return (sum(map(ord, seq.request_id)) * 7 + k * k * 5 + k) % 11


def drive_mock(requests, async_batching: bool, policy: str) -> tuple[dict, Scheduler, int]:
    """The engine loop on a 6-block cache with one-step lookahead (async) or without; returns the generated tokens
    per request, the scheduler, and how often a request preempted while its step was in flight ended on the token
    that step sampled."""
    scheduler = Scheduler(BlockManager(6, 4), 12, 6, policy)
    seqs = [Sequence(name, prompt, SamplingParams(max_new_tokens=new, eos_token_ids=(0,), stop=[[3, 4]]))
            for name, prompt, new in requests]
    for seq in seqs:
        scheduler.add(seq)
    in_flight, ended_while_preempted = None, 0
    while scheduler.has_work or in_flight is not None:
        batch = scheduler.schedule()
        launched = None
        if batch:
            tokens = [(position_token(s), None) if batch.samples(i) else None for i, s in enumerate(batch.sequences)]
            scheduler.advance(batch)
            launched = (batch, tokens)
        done, in_flight = (in_flight, launched) if async_batching else (launched, None)
        if done is not None:
            ended_while_preempted += sum(s.status is RequestStatus.PENDING and t is not None and t[0] == 0
                                         for s, t in zip(done[0].sequences, done[1]))
            scheduler.complete(*done)
            # Prefix sharing registers only real tokens.
            assert all(PLACEHOLDER not in block.token_ids for block in scheduler.block_manager.blocks)
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks and all(b.ref_count == 0 for b in manager.blocks)
    assert all(s.status is RequestStatus.FINISHED and s.num_pending_tokens == 0 for s in seqs)
    return {s.request_id: s.generated_ids for s in seqs}, scheduler, ended_while_preempted


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_scheduler_lookahead_gives_the_synchronous_tokens(policy):
    """Under preemption, prefix sharing, eos and stop sequences, one-step lookahead ends every request with the
    tokens the synchronous loop gives, including requests preempted while their last step was in flight."""
    ended_while_preempted = discarded = 0
    for seed in range(12):
        rng = random.Random(seed)
        requests, previous = [], []
        for i in range(16):
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
            if i % 3 == 2:
                prompt = previous[:6] + prompt  # shares its head with the request before (at most 23 slots in all)
            requests.append((f"r{i}", prompt, rng.randrange(1, 10)))
            previous = prompt
        sync, _, _ = drive_mock(requests, False, policy)
        lookahead, scheduler, ended = drive_mock(requests, True, policy)
        assert lookahead == sync, f"seed {seed}"
        assert scheduler.num_preemptions > 0
        ended_while_preempted += ended
        discarded += scheduler.num_discarded_samples
    assert ended_while_preempted > 0 and discarded > 0


# --- the engine on a tiny model -------------------------------------------------------------------------------


def test_automatic_choice_is_off_on_the_cpu():
    model = tiny_model()
    assert ContinuousBatchingConfig().resolve(model).use_async_batching is False
    assert ContinuousBatchingConfig(use_async_batching=True).resolve(model).use_async_batching is True
    assert ContinuousBatchingConfig(use_async_batching=False).resolve(model).use_async_batching is False


@pytest.mark.parametrize("sharing, policy", [(True, "fifo"), (False, "fifo"), (True, "prefill_first")],
                         ids=["prefix_sharing", "no_sharing", "prefill_first"])
def test_greedy_matches_generate_under_preemption(qwen3, sharing, policy):
    model, prompts, reference = qwen3
    # 12 blocks of 8 for 40 staggered requests of up to 77 tokens: preemption is certain, long prompts are chunked.
    manager = engine(model, True, num_blocks=12, max_batch_tokens=24, allow_block_sharing=sharing,
                     scheduler_type=policy)
    outputs = run_staggered(manager, prompts)
    assert_matches_under_preemption(manager, outputs, prompts, reference, sharing)
    assert manager.num_discarded_samples == 0  # max_new_tokens is known by count: no step past it is launched
    assert_all_free(manager)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_eos_and_stop_sequences_end_requests_early(qwen3, device):
    """Requests that end on a token whose value the host learns only after the next step was launched: the
    lookahead sample is dropped, and every request keeps exactly the tokens the synchronous engine gives."""
    model, prompts, reference = qwen3
    if device == "cuda":  # freed blocks that the dropped step still writes to: safe by stream order
        model = tiny_model().to(device)
        reference = greedy_reference(model, prompts)
    # An eos that the greedy outputs meet part-way, and per-request stop sequences (one token or two) mid-output.
    counts = torch.bincount(torch.tensor([t for ref in reference for t in ref[2:7]]), minlength=128)
    eos = int(counts.argmax())
    stops = [[[ref[4]]] if i % 3 == 0 else [ref[5:7]] if i % 3 == 1 else [] for i, ref in enumerate(reference)]
    expected = [truncated(ref, eos, s) for ref, s in zip(reference, stops)]
    assert sum(len(e) < NEW_TOKENS for e in expected) > len(prompts) // 2

    results = {}
    for async_batching in (False, True):
        manager = engine(model, async_batching, eos_token_id=eos, num_blocks=16, max_batch_tokens=24)
        ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS, stop=s) for p, s in zip(prompts, stops)]
        manager.run_until_done()
        results[async_batching] = [manager.get_result(i, timeout=0) for i in ids]
        assert [o.generated_tokens for o in results[async_batching]] == expected
        assert all(o.status is RequestStatus.FINISHED for o in results[async_batching])
        assert_all_free(manager)
        assert (manager.num_discarded_samples > 0) == async_batching  # the dropped-lookahead path ran
    assert manager.num_finished == len(prompts)  # each request published once


def test_max_new_tokens_is_not_scheduled_past(qwen3):
    """A request whose last token is in flight is known to be done by count: the next step leaves it out."""
    model, prompts, reference = qwen3
    manager = engine(model, True)
    rid = manager.add_request(prompts[0], max_new_tokens=1)
    manager.step()  # launches the prefill, which samples the one token; nothing collected yet
    seq = manager.scheduler.running[0]
    assert seq.num_pending_tokens == 1 and not seq.generated_ids
    assert not manager.scheduler.schedule()
    manager.run_until_done()
    assert manager.get_result(rid, timeout=0).generated_tokens == reference[0][:1]
    assert manager.num_discarded_samples == 0
    assert_all_free(manager)


def test_seeded_sampling_and_logprobs_match_the_synchronous_engine(qwen3):
    model, prompts, _ = qwen3
    settings = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    outputs = {}
    for async_batching in (False, True):
        manager = engine(model, async_batching, num_blocks=20)
        ids = [manager.add_request(p, seed=i, return_logprobs=True, top_logprobs=2 if i % 2 else 0, **settings)
               for i, p in enumerate(prompts[:16])]
        ids.append(manager.add_request(prompts[16], max_new_tokens=8, top_logprobs=3))  # greedy among them
        manager.run_until_done()
        outputs[async_batching] = [manager.get_result(i, timeout=0) for i in ids]
        assert_all_free(manager)
    sync, async_ = outputs[False], outputs[True]
    assert [o.generated_tokens for o in async_] == [o.generated_tokens for o in sync]
    assert len({tuple(o.generated_tokens) for o in sync}) > 1
    for a, s in zip(async_, sync):
        assert len(a.logprobs) == len(s.logprobs) == len(a.generated_tokens)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(s.logprobs), atol=1e-5, rtol=0)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in s.top_logprobs]


def test_prompt_logprobs_match_the_synchronous_engine(qwen3):
    """A step that records prompt logprobs reads them on the host at launch; the rest of the batch is unchanged."""
    model, prompts, _ = qwen3
    outputs = {}
    for async_batching in (False, True):
        manager = engine(model, async_batching, max_batch_tokens=12)
        ids = [manager.add_request(p, max_new_tokens=4, prompt_logprobs=1 if i % 2 else None)
               for i, p in enumerate(prompts[:10])]
        manager.run_until_done()
        outputs[async_batching] = [manager.get_result(i, timeout=0) for i in ids]
        assert_all_free(manager)
    for a, s in zip(outputs[True], outputs[False]):
        assert a.generated_tokens == s.generated_tokens
        assert len(a.prompt_logprobs) == len(s.prompt_logprobs)
        torch.testing.assert_close(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(s.prompt_logprobs[1:]),
                                   atol=1e-5, rtol=0)
        assert [t and [i for i, _ in t] for t in a.prompt_top_logprobs] == \
            [t and [i for i, _ in t] for t in s.prompt_top_logprobs]


def test_cancel_and_streaming_while_a_step_is_in_flight(qwen3):
    model, prompts, reference = qwen3
    manager = engine(model, True)
    streamed = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, streaming=True)
    plain = manager.add_request(prompts[1], max_new_tokens=NEW_TOKENS)
    doomed = manager.add_request(prompts[2], max_new_tokens=NEW_TOKENS)
    for _ in range(4):
        manager.step()
    assert manager._in_flight is not None and doomed in {s.request_id for s in manager._in_flight.batch.sequences}
    manager.cancel_request(doomed)  # its sequence is in the step in flight: that step's sample must be dropped
    manager.run_until_done()
    cancelled = manager.get_result(doomed, timeout=0)
    assert cancelled.status is RequestStatus.FAILED and cancelled.error == "cancelled"
    assert manager.get_result(plain, timeout=0).generated_tokens == reference[1]
    updates = list(manager.request_id_iter(streamed))
    assert [len(u.generated_tokens) for u in updates] == list(range(1, NEW_TOKENS + 1))
    assert updates[-1].generated_tokens == reference[0] and updates[-1].is_finished()
    assert manager.num_finished == 3 and manager.get_result(timeout=0) is None
    assert manager.num_discarded_samples >= 1
    assert_all_free(manager)


def test_threaded_manager(qwen3):
    model, prompts, reference = qwen3
    manager = engine(model, True, num_blocks=16, max_batch_tokens=24)
    with manager:
        ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS) for p in prompts[:12]]
        assert [manager.get_result(i, timeout=60).generated_tokens for i in ids] == reference[:12]
    assert_all_free(manager)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_greedy_matches_generate_on_gpu(use_cuda_graph, async_batching):
    model = tiny_model().to("cuda")
    prompts = make_prompts(40)
    reference = greedy_reference(model, prompts)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=16, num_blocks=24, max_batch_tokens=64,
                                             use_cuda_graph=use_cuda_graph, use_async_batching=async_batching)
    outputs = run_staggered(manager, prompts)
    assert [o.generated_tokens for o in outputs] == reference
    assert manager.num_preemptions > 0
    assert_all_free(manager)
    if use_cuda_graph:
        assert manager.runner.graphs.graphs and not manager.runner.graphs.failed


@pytest.mark.gpu
@needs_cuda
def test_async_batching_is_automatic_on_cuda():
    manager = tiny_model().to("cuda").init_continuous_batching(num_blocks=8)
    assert manager.config.use_async_batching is True
