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
