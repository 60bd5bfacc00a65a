"""The engine on a CUDA device: greedy parity with and without CUDA graphs (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.cuda_graphs import BATCH_BUCKETS, _bucket
from tests.engine.test_engine import NEW_TOKENS, greedy_reference, make_prompts, tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_bucket_is_the_smallest_that_fits():
    assert _bucket(1, BATCH_BUCKETS) == 1
    assert _bucket(17, BATCH_BUCKETS) == 24
    assert _bucket(10_000, BATCH_BUCKETS) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_greedy_matches_generate_on_gpu(use_cuda_graph):
    model = tiny_model().to("cuda")
    prompts = make_prompts(40)
    reference = greedy_reference(model, prompts)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=16, num_blocks=24, max_batch_tokens=64,
                                             use_cuda_graph=use_cuda_graph)
    assert manager.config.use_cuda_graph is use_cuda_graph
    for prompt in prompts:
        manager.add_request(prompt, max_new_tokens=NEW_TOKENS)
    manager.run_until_done()
    outputs = [manager.get_result(f"req_{i}", timeout=0) for i in range(len(prompts))]
    assert [o.generated_tokens for o in outputs] == reference
    assert manager.num_preemptions > 0
    if use_cuda_graph:
        graphs = manager.runner.graphs
        assert not graphs.failed and graphs.graphs, "no CUDA graph was captured or replayed"
        # the Triton decode kernel serves "paged|sdpa" on CUDA: one graph per batch bucket, at the longest context
        assert graphs.per_context is False and {length for _, length in graphs.graphs} == {graphs.context_buckets[-1]}


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_is_automatic_on_cuda():
    model = tiny_model().to("cuda")
    manager = model.init_continuous_batching(num_blocks=8)
    assert manager.config.use_cuda_graph is True and manager.config.block_size == 256


@pytest.mark.gpu
@needs_cuda
def test_steps_never_wait_for_the_device():
    """Async batching launches step N+1 while step N runs: nothing in a step may wait for the device (the event
    wait of `collect` aside), for greedy rows, seeded sampled rows with every filter, penalties, logit bias and
    logprobs. torch.multinomial read its probabilities back in older torch releases: a sampled row waited twice."""
    model = tiny_model().to("cuda")
    prompts = make_prompts(16)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=16, num_blocks=64, max_batch_tokens=64,
                                             use_cuda_graph=False)  # (a capture synchronizes, once per bucket)
    assert manager.config.use_async_batching
    settings = [{}, dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3),
                dict(do_sample=True, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
                dict(logit_bias={5: 2.0}, top_logprobs=3)]
    ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS, **settings[i % 4]) for i, p in enumerate(prompts)]
    torch.cuda.set_sync_debug_mode("error")  # a sync raises inside the step, which fails its requests
    try:
        manager.run_until_done()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    outputs = [manager.get_result(i, timeout=0) for i in ids]
    assert [o.error for o in outputs] == [None] * len(prompts)
    assert all(len(o.generated_tokens) == NEW_TOKENS for o in outputs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_the_engine_thread_serves_a_model_on_the_second_gpu(use_cuda_graph):
    """The loop thread starts on cuda:0: the Triton decode kernel, the step's event and the graph capture must still
    run on cuda:1, the model's device."""
    model = tiny_model().to("cuda:1")
    prompts = make_prompts(12)
    reference = greedy_reference(model, prompts)
    with model.init_continuous_batching(eos_token_id=None, block_size=16, num_blocks=64, max_batch_tokens=64,
                                        use_cuda_graph=use_cuda_graph) as manager:
        ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS) for p in prompts]
        outputs = [manager.get_result(i, timeout=120) for i in ids]
    assert [o.error for o in outputs] == [None] * len(prompts)
    assert [o.generated_tokens for o in outputs] == reference
    if use_cuda_graph:
        assert manager.runner.graphs.graphs and not manager.runner.graphs.failed
