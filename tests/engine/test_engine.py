"""The engine end to end on a tiny random model: greedy tokens identical to single-prompt generate() for 64
requests arriving at different times (prefix sharing on and off, a cache small enough to preempt, small chunked
prefill), the threaded manager API (streaming, cancel, get_result), per-request sampling and logprobs."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.manager import ContinuousBatchingManager
from gpuformers.engine.sequence import RequestStatus

NEW_TOKENS = 10


def tiny_model(model_type="qwen3", **overrides):
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    config = ModelConfig.from_dict(dict(
        model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides))
    torch.manual_seed(0)
    return model_class_for(config)(config).eval()


def make_prompts(count=64, seed=0):
    """Mixed lengths in [1, 48]; every fourth prompt shares a 20-token head with the one before it."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        length = int(torch.randint(1, 49, (), generator=g))
        prompt = torch.randint(0, 128, (length,), generator=g).tolist()
        if i % 4 == 3:
            prompt = prompts[-1][:20] + prompt
        prompts.append(prompt)
    return prompts


def greedy_reference(model, prompts, new_tokens=NEW_TOKENS):
    """One prompt at a time through plain generate (DynamicCache, sdpa)."""
    return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def qwen3():
    model = tiny_model()
    prompts = make_prompts()
    return model, prompts, greedy_reference(model, prompts)


def run_staggered(manager: ContinuousBatchingManager, prompts, per_step=4):
    """Add a few requests, take one step, add more: requests arrive while others run."""
    ids, pending = [], list(prompts)
    while True:
        for prompt in pending[:per_step]:
            ids.append(manager.add_request(prompt, max_new_tokens=NEW_TOKENS))
        pending = pending[per_step:]
        if not manager.step() and not pending:  # (step first: `pending or step()` would add them all at once)
            break
    return [manager.get_result(i, timeout=0) for i in ids]


def assert_matches_under_preemption(manager, outputs, prompts, reference, sharing: bool) -> None:
    """Every request finished with the tokens generate gives it alone, some were preempted on the way, and prefix
    blocks were shared exactly when sharing was on."""
    for i, (output, expected) in enumerate(zip(outputs, reference)):
        assert output.status is RequestStatus.FINISHED, output.error
        assert output.generated_tokens == expected, f"request {i} (prompt length {len(prompts[i])})"
    assert manager.num_preemptions > 0
    assert (manager.prefix_hits > 0) == sharing


@pytest.mark.parametrize("sharing", [True, False], ids=["prefix_sharing", "no_sharing"])
def test_greedy_matches_generate_under_pressure(qwen3, sharing):
    model, prompts, reference = qwen3
    # 12 blocks of 8 = 96 slots for 64 requests of up to 77 tokens: preemption is certain.
    config = ContinuousBatchingConfig(block_size=8, num_blocks=12, max_batch_tokens=24, max_requests_per_batch=16,
                                      allow_block_sharing=sharing)
    assert max(map(len, prompts)) > 2 * config.max_batch_tokens  # long prompts are prefilled in chunks
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    outputs = run_staggered(manager, prompts)
    assert_matches_under_preemption(manager, outputs, prompts, reference, sharing)
    assert manager.block_manager.num_free_blocks == config.num_blocks
    # The model was switched to the paged backend; plain generate still gives the same tokens.
    assert model.attn_implementation == "paged|sdpa"
    assert greedy_reference(model, prompts[:2]) == reference[:2]


def test_generate_batch_eager_backend_and_prefill_first(qwen3):
    model, prompts, reference = qwen3
    model.set_attn_implementation("paged|eager")
    try:
        results = model.generate_batch(prompts[:16], max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                       progress_bar=False, block_size=16, num_blocks=64,
                                       scheduler_type="prefill_first")
    finally:
        model.set_attn_implementation("sdpa")
    assert list(results) == [f"req_{i}" for i in range(16)]
    assert [r.generated_tokens for r in results.values()] == reference[:16]


def test_sliding_window_matches_generate():
    model = tiny_model("mistral", sliding_window=8)
    prompts = make_prompts(12, seed=1)
    reference = greedy_reference(model, prompts)
    results = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=None, progress_bar=False,
                                   block_size=4, num_blocks=40, max_batch_tokens=16)
    assert [r.generated_tokens for r in results.values()] == reference


def test_threaded_manager_streaming_cancel_and_errors(qwen3):
    model, prompts, reference = qwen3
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=16, max_batch_tokens=32)
    with manager:
        streamed = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, streaming=True)
        plain = manager.add_request(prompts[1], request_id="mine", max_new_tokens=NEW_TOKENS)
        too_long = manager.add_request(list(range(100)) * 2, max_new_tokens=4)
        updates = list(manager.request_id_iter(streamed))
        assert [len(u.generated_tokens) for u in updates] == list(range(1, NEW_TOKENS + 1))
        assert updates[-1].generated_tokens == reference[0] and updates[-1].is_finished()
        assert manager.get_result(plain, timeout=30).generated_tokens == reference[1]
        failed = manager.get_result(too_long, timeout=30)
        assert failed.status is RequestStatus.FAILED and "KV cache holds 128" in failed.error
        long = manager.add_request([1, 2, 3], max_new_tokens=120)
        manager.cancel_request(long)
        cancelled = manager.get_result(long, timeout=30)
        assert cancelled.status is RequestStatus.FAILED and cancelled.error == "cancelled"
        assert manager.get_result(timeout=0.05) is None  # every finished output was taken: nothing left over
        anyone = manager.add_request(prompts[2], max_new_tokens=2)
        assert manager.get_result(timeout=30).request_id == anyone  # get_result(None): the next one to finish
    assert not manager.is_running()
    assert manager.block_manager.num_free_blocks == 16


def test_the_manager_forgets_every_request_once_its_output_is_taken(qwen3):
    """A server runs for weeks: after many streaming, plain and cancelled requests (streams read to the end,
    results taken by id or by get_result(None)), the manager holds nothing per request and every block is free."""
    model, prompts, reference = qwen3
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64, max_batch_tokens=64)
    with manager:
        for round_ in range(3):
            streamed = [manager.add_request(p, max_new_tokens=NEW_TOKENS, streaming=True) for p in prompts[:12]]
            by_id = [manager.add_request(p, max_new_tokens=NEW_TOKENS) for p in prompts[12:20]]
            by_any = [manager.add_request(p, max_new_tokens=NEW_TOKENS) for p in prompts[20:26]]
            cancelled_stream = manager.add_request([1, 2, 3], max_new_tokens=200, streaming=True)
            cancelled_plain = manager.add_request([4, 5, 6], max_new_tokens=200)
            manager.cancel_request(cancelled_stream)
            manager.cancel_request(cancelled_plain)
            finals = [list(manager.request_id_iter(r))[-1] for r in streamed]
            assert [f.generated_tokens for f in finals] == reference[:12]
            assert [manager.get_result(r, timeout=30).generated_tokens for r in by_id] == reference[12:20]
            assert list(manager.request_id_iter(cancelled_stream))[-1].error == "cancelled"
            assert manager.get_result(cancelled_plain, timeout=30).error == "cancelled"
            anyone = {manager.get_result(timeout=30).request_id for _ in by_any}
            assert anyone == set(by_any)
            assert manager.get_result(timeout=0) is None
        assert manager.num_finished == 3 * 28
        assert manager.outbox.finished == {} and manager.outbox.streams == {} and manager.outbox.live == set()
        assert not manager.scheduler.waiting and not manager.scheduler.running
    assert manager.block_manager.num_free_blocks == 64


def test_the_config_seed_repeats_a_run_and_identical_prompts_still_get_their_own_samples(qwen3):
    model, prompts, _ = qwen3
    settings = dict(max_new_tokens=8, do_sample=True, temperature=1.5, eos_token_id=None, progress_bar=False)

    def run(seed):
        batch = [prompts[0]] * 4 + [prompts[1]]
        out = model.generate_batch(batch, seed=seed, block_size=8, num_blocks=64, **settings)
        return [r.generated_tokens for r in out.values()]

    first = run(123)
    assert run(123) == first  # the whole run repeats
    assert len({tuple(t) for t in first[:4]}) > 1  # four samples of one prompt, not one sample four times
    assert run(124) != first
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64, seed=123)
    own = manager.add_request(prompts[0], seed=7, max_new_tokens=8, do_sample=True, temperature=1.5)
    manager.run_until_done()
    alone = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    again = alone.add_request(prompts[0], seed=7, max_new_tokens=8, do_sample=True, temperature=1.5)
    alone.run_until_done()  # a request's own seed wins over the config's
    assert manager.get_result(own, timeout=0).generated_tokens == alone.get_result(again, timeout=0).generated_tokens


def test_sampling_is_per_request_and_seeded(qwen3):
    model, prompts, _ = qwen3
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    settings = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    alone = manager.add_request(prompts[5], seed=7, **settings)
    manager.run_until_done()
    crowd = [manager.add_request(p, seed=7 if i == 3 else i, **settings) for i, p in enumerate(prompts[2:10])]
    greedy = manager.add_request(prompts[5], max_new_tokens=8, return_logprobs=True)
    manager.run_until_done()
    tokens = manager.get_result(alone, timeout=0).generated_tokens
    others = [manager.get_result(r, timeout=0).generated_tokens for r in crowd]
    assert others[3] == tokens  # the same seed in a different batch gives the same tokens
    assert len({tuple(t) for t in others}) > 1
    out = manager.get_result(greedy, timeout=0)
    assert len(out.logprobs) == 8
    # Greedy logprobs are the log-softmax of the model's own logits at the chosen tokens.
    full = torch.tensor([prompts[5] + out.generated_tokens])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompts[5]) - 1:-1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.generated_tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_top_logprobs_are_the_most_likely_tokens(qwen3):
    """top_logprobs=k returns, per generated token, the k most likely tokens of the model's own distribution,
    best first, the chosen (greedy) token among them with its logprob."""
    model, prompts, _ = qwen3
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    rid = manager.add_request(prompts[3], max_new_tokens=6, top_logprobs=3)
    plain = manager.add_request(prompts[4], max_new_tokens=6, return_logprobs=True)
    manager.run_until_done()
    out, other = manager.get_result(rid, timeout=0), manager.get_result(plain, timeout=0)
    assert len(out.top_logprobs) == 6 and other.top_logprobs == []
    full = torch.tensor([prompts[3] + out.generated_tokens])
    with torch.no_grad():
        log_probs = model(full).logits[0, len(prompts[3]) - 1:-1].float().log_softmax(-1)
    for step, (token, logprob, top) in enumerate(zip(out.generated_tokens, out.logprobs, out.top_logprobs)):
        values, ids = log_probs[step].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=1e-4)
        assert top[0] == (token, logprob)
    with pytest.raises(ValueError, match="top_logprobs=21"):
        manager.add_request(prompts[3], top_logprobs=21)


def test_memory_summary_says_where_memory_goes(qwen3):
    from gpuformers.engine.model_runner import kv_bytes_per_block

    model = qwen3[0]
    manager = model.init_continuous_batching(num_blocks=8, block_size=16, prepack_weights=False)  # (tests/kernels/test_cpu_linear.py)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = kv_bytes_per_block(model.config, 16, model.dtype) * 9  # the 8 blocks and the scratch block
    summary = manager.memory_summary()
    assert summary.startswith(f"weights {weights / (1 << 20):.1f} MiB, KV cache {cache / (1 << 20):.1f} MiB ")
    assert "(8 blocks of 16 tokens = 128 tokens)" in summary and "free on cpu" in summary


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="block_size=48 must be a power of two"):
        ContinuousBatchingConfig(block_size=48)
    with pytest.raises(ValueError, match="max_memory_percent=1.5"):
        ContinuousBatchingConfig(max_memory_percent=1.5)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs the model on a CUDA device"):
        ContinuousBatchingConfig(use_cuda_graph=True).resolve(tiny_model())


@pytest.mark.parametrize("triton", [False, True], ids=["torch_batched", "triton_kernel"])
def test_gpu_decode_paths_on_cpu(qwen3, monkeypatch, triton):
    """The decode paths a GPU takes (batched torch gather, or the Triton kernel under the interpreter), forced on."""
    from gpuformers.engine import paged_attention
    from gpuformers.kernels.checks import triton_runs_on

    if triton and not triton_runs_on("cpu")[0]:
        pytest.skip(triton_runs_on("cpu")[1])
    model, prompts, reference = qwen3
    monkeypatch.setattr(paged_attention, "_batch_decodes", lambda query, ctx: True)
    monkeypatch.setattr(paged_attention, "_triton_kernels_available", lambda query: triton)
    count = 6 if triton else 24
    results = model.generate_batch(prompts[:count], max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                   progress_bar=False, block_size=8, num_blocks=64)
    assert [r.generated_tokens for r in results.values()] == reference[:count]
