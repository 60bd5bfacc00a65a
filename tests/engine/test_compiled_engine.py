"""The engine's compiled decoder (engine/compiled_step.py): greedy tokens equal generate() for staggered requests
with chunked prefills, preemption and prefix sharing, with one graph in all (dynamic in the step's tokens; a one-token step padded to two)
and no recompilation as the step's layout changes; and the compile decision (ContinuousBatchingConfig.compile).

The whole engine suite also runs compiled under GPUFORMERS_ENGINE_COMPILE=1 (docs/engine.md)."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.compiled_step import decide_compile
from gpuformers.engine.config import ContinuousBatchingConfig
from tests.engine.test_engine import assert_matches_under_preemption, qwen3, run_staggered, tiny_model  # noqa: F401 (qwen3: the fixture)


def run_compiled(model, prompts, config: ContinuousBatchingConfig):
    """A compiled engine (config.compile=True) over staggered requests, from a fresh Dynamo: (manager, outputs,
    Dynamo graphs compiled on the way)."""
    torch._dynamo.reset()
    # Counted from here: dynamo's counters outlive reset(), and other tests of this process compiled graphs before
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
        assert manager.runner.compiled is not None
        outputs = run_staggered(manager, prompts)
        return manager, outputs, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_engine_matches_generate_without_recompiling(qwen3):
    model, prompts, reference = qwen3
    config = ContinuousBatchingConfig(block_size=8, num_blocks=12, max_batch_tokens=24, max_requests_per_batch=16,
                                      compile=True)
    manager, outputs, graphs = run_compiled(model, prompts, config)
    packed = manager.runner.packed  # only the LM head, which runs eagerly, gets a copy of its weight
    assert packed is None or packed.layers == [model.lm_head]
    assert_matches_under_preemption(manager, outputs, prompts, reference, sharing=True)
    # Hundreds of steps of different sizes (one-token steps among them), block tables and context lengths: one graph.
    assert graphs == 1


def test_compile_decision(monkeypatch):
    monkeypatch.delenv("GPUFORMERS_ENGINE_COMPILE", raising=False)  # (the suite also runs under the switch)
    model = tiny_model()
    assert decide_compile(model, None, has_states=False)[0] is False  # off unless asked
    assert decide_compile(model, True, has_states=False)[0] is True
    assert decide_compile(model, False, has_states=False)[0] is False
    with pytest.raises(NotImplementedError, match="mamba"):
        decide_compile(model, True, has_states=True)
    parallel = tiny_model()
    parallel.tp_plan = "auto"  # what apply_tensor_parallel leaves (tests/engine/test_lockstep.py runs one for real)
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        decide_compile(parallel, True, has_states=False)
    moe = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert decide_compile(moe, True, has_states=False)[0] is True  # on the CPU: its expert loop as one op
    with pytest.raises(NotImplementedError, match="host"):  # off the CPU (CUDA: a wait at every step)
        decide_compile(moe.to("meta"), True, has_states=False)


def test_compile_under_the_environment_switch(monkeypatch):
    monkeypatch.setenv("GPUFORMERS_ENGINE_COMPILE", "1")
    assert decide_compile(tiny_model(), None, has_states=False)[0] is True
    moe = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert decide_compile(moe, None, has_states=False)[0] is True
    assert decide_compile(moe.to("meta"), None, has_states=False)[0] is False  # eager, with the reason logged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["eager_decodes", "cuda_graph_decodes"])
def test_compiled_engine_on_gpu(dtype, use_cuda_graph):
    """The compiled decoder on CUDA (the Triton paged kernels inside the op), with decode steps replaying CUDA
    graphs or not: greedy tokens equal generate() in float32; in bfloat16 at least 90% of the sequences do
    (rounding differs between a fused graph and the eager ops)."""
    from tests.engine.test_engine import greedy_reference, make_prompts

    model = tiny_model().to("cuda", dtype)
    prompts = make_prompts(40)
    reference = greedy_reference(model, prompts)
    torch._dynamo.reset()
    try:
        manager = model.init_continuous_batching(eos_token_id=None, block_size=16, num_blocks=24, max_batch_tokens=64,
                                                 use_cuda_graph=use_cuda_graph, compile=True)
        ids = [manager.add_request(p, max_new_tokens=10) for p in prompts]
        manager.run_until_done()
        outputs = [manager.get_result(i, timeout=0).generated_tokens for i in ids]
    finally:
        torch._dynamo.reset()
    same = sum(o == r for o, r in zip(outputs, reference))
    assert same == len(prompts) if dtype == torch.float32 else same >= 0.9 * len(prompts)
