"""The engine's compiled decoder serving a mixture-of-experts model on the CPU (engine/compiled_step.py,
layers/moe.py): the torch MoE block's expert loop, whose host wait a graph cannot hold, runs inside the compiled graph
as one opaque op (gpuformers::experts_outside_graph), so compile=True is no longer refused for it; greedy tokens equal
generate() for staggered requests under preemption and prefix sharing, with one graph in all."""

from __future__ import annotations

import copy

import pytest

from gpuformers.engine.compiled_step import decide_compile
from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.layers.moe import SparseMoeBlock
from tests.engine.test_compiled_engine import run_compiled
from tests.engine.test_engine import assert_matches_under_preemption, greedy_reference, make_prompts, tiny_model

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.slow
@pytest.mark.parametrize("gathered", [False, True], ids=["loop_as_op", "after_generate_compiled"])
def test_compiled_engine_serves_moe_like_generate(gathered):
    """gathered: the blocks carry generate()'s compiled-step run_experts (generation/compiled_step.py), which
    gathers the experts for steps of few tokens: a second graph for the larger steps, the same tokens."""
    from gpuformers.generation.compiled_step import install_gathered_experts, liftable

    model = tiny_model("qwen3_moe", **MOE)
    if gathered:
        install_gathered_experts(liftable(model))
    prompts = make_prompts(32)
    reference = greedy_reference(model, prompts)
    config = ContinuousBatchingConfig(block_size=8, num_blocks=10, max_batch_tokens=24, max_requests_per_batch=16,
                                      compile=True)
    manager, outputs, graphs = run_compiled(model, prompts, config)
    assert_matches_under_preemption(manager, outputs, prompts, reference, sharing=True)
    # One graph for every step size: the expert loops (a graph break each, without the op) are inside it; with the
    # gathered experts, one for steps of tokens * top_k <= experts and one for the others.
    assert graphs == (2 if gathered else 1)


def test_moe_compile_decision():
    """compile=True serves the torch MoE block on the CPU; a block without its op key (a subclass that skipped
    SparseMoeBlock.__init__) is refused, naming it; a copy of a model gets keys of its own."""
    model = tiny_model("qwen3_moe", **MOE)
    assert decide_compile(model, True, has_states=False) == (True, "compile=True")
    copied = copy.deepcopy(model)
    keys = {m.outside_graph_key for m in (*model.modules(), *copied.modules()) if isinstance(m, SparseMoeBlock)}
    assert len(keys) == 2 * model.config.num_hidden_layers
    block = model.model.layers[1].mlp
    block.outside_graph_key = None
    with pytest.raises(NotImplementedError, match="model.layers.1.mlp reads values on the host"):
        decide_compile(model, True, has_states=False)
