"""generate()'s compiled decode step on the CPU with Inductor (generation/compiled_step.py): weight freezing and
concatenated sibling matmuls give the eager tokens, the frozen weights are real graph constants, and a weight
changed in place after compiling is seen by the next call (the step is rebuilt)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import hf_config


def _model(model_type: str, **overrides):
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    config = ModelConfig.from_dict(hf_config(model_type, bos_token_id=1, eos_token_id=None, **overrides).to_dict())
    torch.manual_seed(0)
    return model_class_for(config)(config).eval()


@pytest.mark.slow
def test_cpu_compiled_step_freezes_weights_and_follows_in_place_edits():
    from gpuformers.generation.config import CompileConfig

    model = _model("llama")
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=6, eos_token_id=None, cache_implementation="static",
                    compile_config=CompileConfig(mode="default"))
    graphs = []
    try:
        from torch._inductor import graph as inductor_graph

        real_init = inductor_graph.GraphLowering.__init__

        def recording_init(self, gm, *args, **kwargs):  # the FX graph Inductor lowers, after freezing
            graphs.append(gm)
            real_init(self, gm, *args, **kwargs)

        inductor_graph.GraphLowering.__init__ = recording_init
        try:
            compiled = model.generate(ids, **settings)
        finally:
            inductor_graph.GraphLowering.__init__ = real_init
        assert torch.equal(compiled, model.generate(ids, max_new_tokens=6, eos_token_id=None))
        # Frozen: the projection weights are constants of the lowered graph, not inputs.
        constants = [n for gm in graphs for n in gm.graph.nodes if n.op == "get_attr"]
        assert len(constants) >= model.config.num_hidden_layers
        step = model._compiled_decode

        with torch.no_grad():  # an in-place edit (as load_state_dict or an optimizer step makes)
            for layer in model.model.layers:
                layer.mlp.down_proj.weight.mul_(-1.5)
        eager = model.generate(ids, max_new_tokens=6, eos_token_id=None)
        assert not torch.equal(eager, compiled)  # the edit changes the tokens...
        assert torch.equal(model.generate(ids, **settings), eager)  # ...and the compiled step follows it
        assert model._compiled_decode is not step
    finally:
        model.__dict__.pop("_compiled_decode", None)
        torch._dynamo.reset()


def _generate_compiled(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list]:
    """generate() through the compiled step from a fresh Dynamo, its graphs kept by a recording backend (run as
    they are): (the tokens, the FX graphs compiled)."""
    from gpuformers.generation.config import CompileConfig

    graphs = []

    def counting_backend(gm, example_inputs, **options):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        tokens = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, cache_implementation="static",
                                compile_config=CompileConfig(backend=counting_backend))
        assert hasattr(model, "_compiled_decode")
    finally:
        model.__dict__.pop("_compiled_decode", None)
        torch._dynamo.reset()
    return tokens, graphs


@pytest.mark.parametrize("rows", [1, 3], ids=["gathered", "outside_graph"])
def test_moe_blocks_compile_without_host_waits(rows):
    """A mixture-of-experts model on the CPU: the compiled step replaces its blocks' expert loop (a host wait), so
    the decode step is one graph built once, with the eager tokens. One row (2 assignments <= 4 experts): the experts
    are gathered inside the graph, no opaque op; three rows (6 assignments): each block's own loop runs as one op
    inside the graph; outside the step the blocks still count as waiting on the host."""
    from gpuformers.layers.moe import host_syncing_modules

    model = _model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    ids = torch.randint(3, 128, (rows, 7), generator=torch.Generator().manual_seed(0))
    compiled, graphs = _generate_compiled(model, ids, 8)
    assert torch.equal(compiled, model.generate(ids, max_new_tokens=8, eos_token_id=None))
    assert len(graphs) == 1
    op = torch.ops.gpuformers.experts_outside_graph
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
    assert len(calls) == (0 if rows == 1 else model.config.num_hidden_layers)
    # Outside the step the blocks still wait on the host (what CUDA graph decisions read)
    assert len(host_syncing_modules(model)) == model.config.num_hidden_layers


def test_mixtral_experts_run_outside_the_compiled_graph():
    """Mixtral's experts (w1 / w3 / w2, not a GatedMLP) are not gathered: even at batch 1 its blocks' loop runs as
    the opaque op, with the eager tokens (its float32 router weights and its own block forward kept)."""

    model = _model("mixtral", num_local_experts=4, num_experts_per_tok=2)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    compiled, graphs = _generate_compiled(model, ids, 6)
    assert torch.equal(compiled, model.generate(ids, max_new_tokens=6, eos_token_id=None))
    op = torch.ops.gpuformers.experts_outside_graph
    assert len(graphs) == 1
    assert sum(n.target in (op, op.default) for n in graphs[0].graph.nodes) == model.config.num_hidden_layers


@pytest.mark.parametrize("float32_weights", [False, True], ids=["model_dtype_weights", "float32_weights"])
def test_gathered_experts_match_the_expert_loop(float32_weights):
    """The gathered experts (no host sync) against the block's own loop, for one token and for as many assignments
    as experts, the top_k experts in any order: float32 within 1e-5."""
    from gpuformers.generation.compiled_step import _gathered_experts, _gatherable
    from gpuformers.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(hidden_size=32, intermediate_size=24, num_experts=4, top_k=2, norm_topk_prob=True).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.2)
    block.gate.float32_weights = float32_weights
    assert _gatherable(block)
    for tokens in (1, 2):
        x = torch.randn(tokens, 32)
        _, weights, experts = block.gate(x)
        with torch.no_grad():
            expected = block.run_experts(x, weights, experts)
            got = _gathered_experts(block, x, weights, experts)
            swapped = _gathered_experts(block, x, weights.flip(1), experts.flip(1))
        assert got.dtype == x.dtype
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(swapped, expected, atol=1e-5, rtol=0)
