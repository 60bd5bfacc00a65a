"""CUDA graphs for decode steps of models with mamba layers (engine/cuda_graphs.py, engine/state_slots.py).

On the CPU the capture is swapped for the stand-in of test_cuda_graph_buffers.py (its replay reruns the forward over
the same static buffers): the decode rows' slot index as a static buffer, padding rows on the pool's scratch row,
snapshots and fresh slots handled around the replay, under preemption, small chunks and prefix caching, greedy
tokens equal generate()'s (Mamba2, Nemotron-H without MoE, Falcon-H1); with use_kernels=True the in-place state kernels (the interpreter) read the static
index. On a GPU (`gpu`-marked, run by scripts/gpu_check.sh's `pytest -m gpu`) the real capture: a tiny Nemotron-H's
greedy tokens with graphs on equal graphs off, float32 and bfloat16, with and without use_kernels=True."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.cuda_graphs import decide_cuda_graph
from gpuformers.engine.sequence import RequestStatus
from tests.engine.test_cuda_graph_buffers import ReplayedEagerly
from tests.engine.test_engine import make_prompts, run_staggered
from tests.engine.test_hybrid_engine import FAMILIES, greedy_alone, tiny_hybrid

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
# Nemotron-H without its MoE block, whose torch forward reads the routed experts on the host (no graph for it)
NO_MOE = ["mamba", "attention", "mlp", "mamba"]


def nemotron_h_without_moe():
    saved = FAMILIES["nemotron_h"]
    FAMILIES["nemotron_h"] = dict(saved, layers_block_type=NO_MOE, num_hidden_layers=len(NO_MOE))
    try:
        return tiny_hybrid("nemotron_h")
    finally:
        FAMILIES["nemotron_h"] = saved


def replaying_manager(model, config):
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    assert manager.config.use_cuda_graph is False  # the CPU default; the stand-in is put in by hand
    manager.runner.graphs = ReplayedEagerly(manager.runner, manager.config.max_requests_per_batch)
    return manager


def watch_state_rows(graphs) -> list[tuple[int, int]]:
    """Checks, at every replayed step, the static index the graph reads: the step's slots, then the scratch row up to
    the bucket. Returns (decodes, bucket) per replayed step."""
    seen, real_run = [], graphs.run
    scratch = graphs.runner.states.scratch_row

    def run(input_ids, position_ids, context, states=None):
        logits = real_run(input_ids, position_ids, context, states)
        n = input_ids.shape[1]
        bucket = next(b for b in graphs.batch_buckets if b >= n)
        assert torch.equal(graphs.state_rows[:n], states.decode_rows)
        assert (graphs.state_rows[n:bucket] == scratch).all()
        assert scratch not in states.decode_rows.tolist()
        seen.append((n, bucket))
        return logits

    graphs.run = run
    return seen


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h", "falcon_h1"])
def family(request):
    # (Granite 4's MoE block waits on the host: no graphs for it)
    model = nemotron_h_without_moe() if request.param == "nemotron_h" else tiny_hybrid(request.param)
    prompts = make_prompts(20, seed=5)
    return model, prompts, greedy_alone(model, prompts)


@pytest.mark.parametrize("sharing", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_replayed_decode_steps_give_generates_tokens(family, sharing):
    model, prompts, reference = family
    config = ContinuousBatchingConfig(block_size=8, num_blocks=12, max_batch_tokens=24, max_requests_per_batch=16,
                                      allow_block_sharing=sharing)
    manager = replaying_manager(model, config)
    graphs, states = manager.runner.graphs, manager.states
    seen = watch_state_rows(graphs)
    outputs = run_staggered(manager, prompts)
    for i, (output, expected) in enumerate(zip(outputs, reference)):
        assert output.status is RequestStatus.FINISHED, output.error
        assert output.generated_tokens == expected, f"request {i} (prompt length {len(prompts[i])})"
    assert not graphs.failed and seen, "no decode step replayed"
    assert any(n < bucket for n, bucket in seen), "no step was padded to a larger batch bucket"
    assert manager.num_preemptions > 0
    if sharing:
        assert states.snapshots_taken > 0 and states.snapshot_hits > 0
    # the scratch row is no sequence's: every slot came back, and the padding rows stepped the scratch row alone
    assert sorted(states.free_live) == list(range(config.max_requests_per_batch))
    assert states.scratch_row == states.conv.shape[1] - 1 == config.max_requests_per_batch + states.snapshot_slots
    assert states.scratch_row not in states.free_snapshots + list(states.snapshots.values())
    assert states.ssm[:, states.scratch_row].abs().sum() > 0


def test_the_kernels_step_the_slots_from_the_static_index(monkeypatch):
    """use_kernels=True: inside the replayed steps the in-place conv-update and state-step kernels (the interpreter)
    read the graph's static index, and the tokens are the kernelized generate()'s."""
    pytest.importorskip("triton")
    import gpuformers.kernels.causal_conv1d as conv
    import gpuformers.kernels.ssd as ssd
    from gpuformers.kernels import kernelize
    from tests.kernels.test_ssd_kernels import _count_kernel_calls

    model = kernelize(nemotron_h_without_moe())
    prompts = [[5, 6, 7, 8], [9, 10], [3, 4, 11, 12, 13, 14]]  # short: the interpreter runs every program in Python
    reference = greedy_alone(model, prompts, 3)
    manager = replaying_manager(model, ContinuousBatchingConfig(block_size=8, num_blocks=64, max_batch_tokens=64,
                                                                max_requests_per_batch=4))
    seen = watch_state_rows(manager.runner.graphs)
    calls = _count_kernel_calls(monkeypatch, ((conv, "causal_conv1d_indexed_forward", "conv"),
                                              (ssd, "ssm_state_step_indexed_forward", "step")))
    ids = [manager.add_request(p, max_new_tokens=3) for p in prompts]
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in ids] == reference
    assert seen and any(n < bucket for n, bucket in seen)
    assert calls["conv"] and calls["step"], calls


def test_graphs_are_decided_for_hybrid_models_as_for_the_others():
    """No refusal of its own: a hybrid model on a GPU gets graphs automatically unless a layer waits on the host (the
    torch MoE block of Nemotron-H), which use_cuda_graph=True names."""
    assert decide_cuda_graph(None, nemotron_h_without_moe(), cuda=True, tp_size=1) is True
    with_moe = tiny_hybrid("nemotron_h")
    assert decide_cuda_graph(None, with_moe, cuda=True, tp_size=1) is False
    with pytest.raises(ValueError, match=r"NemotronHMoE\) reads which experts got tokens on the host"):
        decide_cuda_graph(True, with_moe, cuda=True, tp_size=1)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs the model on a CUDA device"):
        ContinuousBatchingConfig(use_cuda_graph=True).resolve(nemotron_h_without_moe())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_greedy_tokens_with_graphs_equal_without_on_gpu(dtype, use_kernels):
    model = nemotron_h_without_moe().to("cuda", dtype)
    if use_kernels:
        from gpuformers.kernels import kernelize

        model = kernelize(model)
    prompts = make_prompts(24, seed=6)
    tokens = {}
    for graphs_on in (False, True):
        config = ContinuousBatchingConfig(block_size=16, num_blocks=24, max_batch_tokens=64, max_requests_per_batch=16,
                                          use_cuda_graph=graphs_on)
        manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
        assert manager.config.use_cuda_graph is graphs_on
        outputs = run_staggered(manager, prompts)
        assert [o.error for o in outputs] == [None] * len(prompts)
        tokens[graphs_on] = [o.generated_tokens for o in outputs]
        if graphs_on:
            graphs = manager.runner.graphs
            assert not graphs.failed and graphs.graphs, "no CUDA graph was captured or replayed"
            assert any(rows > 1 for rows, _ in graphs.graphs)
    assert tokens[True] == tokens[False]
    if dtype == torch.float32:
        assert tokens[False] == greedy_alone(model, prompts)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_is_automatic_for_a_hybrid_model_on_cuda():
    model = nemotron_h_without_moe().to("cuda")
    manager = model.init_continuous_batching(num_blocks=8)
    assert manager.config.use_cuda_graph is True


@pytest.mark.gpu
@needs_cuda
def test_hybrid_steps_never_wait_for_the_device():
    """Async batching launches step N+1 while step N runs: the state slots' plan (fresh slots zeroed, snapshots
    restored and taken, the decodes' slot index) must not wait for the device either. Eager steps (a capture
    synchronizes, once per bucket)."""
    model = nemotron_h_without_moe().to("cuda")
    prompts = make_prompts(12, seed=7)
    prompts += [prompts[0][:20] + p for p in prompts[1:4]]  # a shared prefix: snapshots taken and restored
    config = ContinuousBatchingConfig(block_size=8, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8,
                                      use_cuda_graph=False)
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    assert manager.config.use_async_batching
    ids = [manager.add_request(p, max_new_tokens=6) for p in prompts]
    torch.cuda.set_sync_debug_mode("error")  # a sync raises inside the step, which fails its requests
    try:
        manager.run_until_done()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [manager.get_result(i, timeout=0).error for i in ids] == [None] * len(prompts)
    assert manager.states.snapshots_taken and manager.states.snapshot_hits  # (as on the CPU: 3 and 1)
