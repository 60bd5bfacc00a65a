"""The CUDA-graph decode path on the CPU: everything DecodeGraphs does around a capture (batch and context buckets,
the static input buffers, padding rows that write to the scratch block, the logits of the real rows) runs here with
the capture swapped for a stand-in that recomputes the same forward over the same buffers at each replay. A GPU run
(test_engine_gpu.py) adds only the capture itself."""

from __future__ import annotations

import pytest

from gpuformers.engine.cuda_graphs import DecodeGraphs
from tests.engine.test_engine import NEW_TOKENS, greedy_reference, make_prompts, tiny_model


class ReplayedEagerly(DecodeGraphs):
    """A "graph" whose replay reruns the captured forward over the static buffers, as a CUDA graph replay reruns its
    kernels on the same addresses."""

    def _capture(self, rows: int, length: int):
        self._forward(rows, length)  # as the real capture's warm-up
        graphs = self

        class Replay:
            def replay(self):
                graphs._forward(rows, length)

        return Replay()


@pytest.fixture(scope="module")
def model_and_reference():
    model = tiny_model()
    prompts = make_prompts(40)
    return model, prompts, greedy_reference(model, prompts)


def replaying_manager(model, **config):
    manager = model.init_continuous_batching(eos_token_id=None, **config)
    assert manager.config.use_cuda_graph is False  # the CPU default; the stand-in is put in by hand
    manager.runner.graphs = ReplayedEagerly(manager.runner, manager.config.max_requests_per_batch)
    return manager


def test_decode_steps_through_the_static_buffers_give_generates_tokens(model_and_reference):
    model, prompts, reference = model_and_reference
    manager = replaying_manager(model, block_size=16, num_blocks=24, max_batch_tokens=64)
    replays = []
    graphs = manager.runner.graphs
    real_run = graphs.run

    def counting_run(input_ids, position_ids, context, states=None):
        replays.append(input_ids.shape[1])
        return real_run(input_ids, position_ids, context, states)

    graphs.run = counting_run
    for prompt in prompts:
        manager.add_request(prompt, max_new_tokens=NEW_TOKENS)
    manager.run_until_done()
    outputs = [manager.get_result(f"req_{i}", timeout=0) for i in range(len(prompts))]
    assert [o.generated_tokens for o in outputs] == reference
    assert manager.num_preemptions > 0  # sequences came back after their blocks were taken: tables changed
    assert not graphs.failed and replays, "no decode step went through the static buffers"
    rows_captured = {rows for rows, _ in graphs.graphs}
    assert any(n not in rows_captured for n in replays), "no step was padded to a larger batch bucket"
    assert manager.block_manager.num_free_blocks == manager.block_manager.num_blocks
    # Block tables per context bucket, as wide as the bucket's blocks, not one as wide as the whole cache
    assert all(table.shape == (graphs.batch_buckets[-1], length // 16) for length, table in graphs.block_tables.items())


def test_a_prompt_of_one_token_and_single_decodes(model_and_reference):
    """Batch bucket 1 (no padding), a context of one block, and contexts that grow through the buckets."""
    model, _, _ = model_and_reference
    prompts = [[5], [7, 8, 9]]
    reference = greedy_reference(model, prompts, new_tokens=20)
    manager = replaying_manager(model, block_size=4, num_blocks=16, max_batch_tokens=16)
    for prompt in prompts:  # one at a time: each decodes alone
        request = manager.add_request(prompt, max_new_tokens=20)
        manager.run_until_done()
        assert manager.get_result(request, timeout=0).generated_tokens == reference[prompts.index(prompt)]
    assert {(1, 4), (1, 8), (1, 16), (1, 32)} <= set(manager.runner.graphs.graphs)


def test_torch_decode_attention_keeps_a_graph_per_context_bucket(model_and_reference):
    """The torch decode path gathers keys up to the bucket, so its graphs are per (batch, context) bucket."""
    model, _, _ = model_and_reference
    reference = greedy_reference(model, [[5, 6]], new_tokens=40)
    manager = replaying_manager(model, block_size=16, num_blocks=24, max_batch_tokens=64)
    request = manager.add_request([5, 6], max_new_tokens=40)  # contexts 3..41: buckets 16, 32 and 64
    manager.run_until_done()
    assert manager.get_result(request, timeout=0).generated_tokens == reference[0]
    graphs = manager.runner.graphs
    assert graphs.per_context is True
    assert {length for _, length in graphs.graphs} == {16, 32, 64}
    # the buckets stop at max_position_embeddings (256), not at the whole cache (24 blocks of 16 = 384 tokens)
    assert graphs.context_buckets[-1] == 256


def test_triton_decode_kernel_needs_one_graph_per_batch_bucket(model_and_reference, monkeypatch):
    """The Triton kernel (here under the interpreter) reads each row's own keys through the block table, whatever its
    width: one graph per batch bucket, at the longest context, and the same tokens."""
    from gpuformers.engine import paged_attention

    monkeypatch.setattr(paged_attention, "_triton_kernels_available", lambda query: True)
    model, prompts, reference = model_and_reference
    manager = replaying_manager(model, block_size=16, num_blocks=24, max_batch_tokens=64)
    for prompt in prompts[:6]:  # few: the interpreter runs each kernel program in Python
        manager.add_request(prompt, max_new_tokens=NEW_TOKENS)
    manager.run_until_done()
    assert [manager.get_result(f"req_{i}", timeout=0).generated_tokens for i in range(6)] == reference[:6]
    graphs = manager.runner.graphs
    assert graphs.per_context is False
    assert graphs.graphs and {length for _, length in graphs.graphs} == {graphs.context_buckets[-1]}
    assert list(graphs.block_tables) == [graphs.context_buckets[-1]]


def test_a_context_past_the_longest_bucket_runs_eagerly():
    """A rotary model goes on past max_position_embeddings; such a step is not given to a graph."""
    model = tiny_model(rope_scaling=None)
    model.config.max_position_embeddings = 32
    prompt = list(range(1, 30))
    reference = greedy_reference(model, [prompt], new_tokens=8)
    manager = replaying_manager(model, block_size=8, num_blocks=16, max_batch_tokens=64)
    graphs = manager.runner.graphs
    assert graphs.context_buckets[-1] == 32
    request = manager.add_request(prompt, max_new_tokens=8)
    manager.run_until_done()
    assert manager.get_result(request, timeout=0).generated_tokens == reference[0]
    assert graphs.graphs and all(length <= 32 for _, length in graphs.graphs)  # the steps up to 32 did replay
