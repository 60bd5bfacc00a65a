"""The engine's compiled decoder (engine/compiled_step.py): greedy tokens equal generate() for staggered requests
with chunked prefills, preemption and prefix sharing, with two graphs in all (one token; any other count, dynamic)
and no recompilation as the step's layout changes; and the compile decision (ContinuousBatchingConfig.compile).

The whole engine suite also runs compiled under GPUFORMERS_ENGINE_COMPILE=1 (docs/engine.md)."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.compiled_step import decide_compile
from gpuformers.engine.config import ContinuousBatchingConfig
from tests.engine.test_engine import assert_matches_under_preemption, qwen3, run_staggered, tiny_model  # noqa: F401 (qwen3: the fixture)


@pytest.mark.slow
def test_compiled_engine_matches_generate_without_recompiling(qwen3):
    model, prompts, reference = qwen3
    config = ContinuousBatchingConfig(block_size=8, num_blocks=12, max_batch_tokens=24, max_requests_per_batch=16,
                                      compile=True)
    torch._dynamo.reset()
    try:
        manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
        assert manager.runner.compiled is not None
        packed = manager.runner.packed  # only the LM head, which runs eagerly, gets a copy of its weight
        assert packed is None or packed.layers == [model.lm_head]
        outputs = run_staggered(manager, prompts)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert_matches_under_preemption(manager, outputs, prompts, reference, sharing=True)
    # Hundreds of steps of different sizes, block tables and context lengths: two graphs, never more.
    assert graphs == 2


def test_compile_decision():
    model = tiny_model()
    assert decide_compile(model, None, has_states=False)[0] is False  # off unless asked
    assert decide_compile(model, True, has_states=False)[0] is True
    assert decide_compile(model, False, has_states=False)[0] is False
    with pytest.raises(NotImplementedError, match="mamba"):
        decide_compile(model, True, has_states=True)
    moe = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(NotImplementedError, match="host"):
        decide_compile(moe, True, has_states=False)


def test_compile_under_the_environment_switch(monkeypatch):
    monkeypatch.setenv("GPUFORMERS_ENGINE_COMPILE", "1")
    assert decide_compile(tiny_model(), None, has_states=False)[0] is True
    moe = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert decide_compile(moe, None, has_states=False)[0] is False  # eager, with the reason logged
