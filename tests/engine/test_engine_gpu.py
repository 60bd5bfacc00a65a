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


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_is_automatic_on_cuda():
    model = tiny_model().to("cuda")
    manager = model.init_continuous_batching(num_blocks=8)
    assert manager.config.use_cuda_graph is True and manager.config.block_size == 256
