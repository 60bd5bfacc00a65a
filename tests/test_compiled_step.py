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


def test_moe_blocks_run_outside_the_compiled_graph():
    """A mixture-of-experts model on the CPU: its torch expert loop (a host wait) runs as one op inside the compiled
    step, so the decode step is one graph built once, with the eager tokens; the blocks' forward is theirs again
    after the call."""
    from gpuformers.generation.config import CompileConfig

    model = _model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    graphs = []

    def counting_backend(gm, example_inputs, **options):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        compiled = model.generate(ids, max_new_tokens=8, eos_token_id=None, cache_implementation="static",
                                  compile_config=CompileConfig(backend=counting_backend))
        assert hasattr(model, "_compiled_decode")
    finally:
        model.__dict__.pop("_compiled_decode", None)
        torch._dynamo.reset()
    assert torch.equal(compiled, model.generate(ids, max_new_tokens=8, eos_token_id=None))
    assert len(graphs) == 1
    op = torch.ops.gpuformers.module_outside_graph
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
    assert len(calls) == model.config.num_hidden_layers
    assert all("forward" not in m.__dict__ for m in model.modules())
