"""Whether the engine captures CUDA graphs for a model: not for one whose forward waits on the host (the torch
mixture-of-experts blocks read the routed experts with .tolist()), unless a kernel replaced that forward. The
decision is a function of the model, so it is tested here without a GPU (`cuda=True` stands for the device)."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.cuda_graphs import decide_cuda_graph
from gpuformers.layers.moe import host_syncing_modules

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)


def _model(model_type: str, **extra):
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    config = ModelConfig.from_dict({"model_type": model_type, **SHAPE, **extra})
    torch.manual_seed(0)
    return model_class_for(config)(config).eval()


def test_dense_model_captures():
    model = _model("qwen3")
    assert host_syncing_modules(model) == []
    assert decide_cuda_graph(None, model, cuda=True, tp_size=1) is True
    assert decide_cuda_graph(None, model, cuda=False, tp_size=1) is False  # the CPU has no graphs
    assert decide_cuda_graph(None, model, cuda=True, tp_size=2) is False  # collectives inside a graph: not yet
    assert decide_cuda_graph(False, model, cuda=True, tp_size=1) is False


@pytest.mark.parametrize("model_type, extra, layer", [
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), "SparseMoeBlock"),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2), "GptOssExperts"),
])
def test_moe_blocks_that_wait_on_the_host_turn_graphs_off(model_type, extra, layer, caplog):
    import logging

    model = _model(model_type, **extra)
    blockers = host_syncing_modules(model)
    assert blockers and all(layer in type(model.get_submodule(name)).__name__ for name in blockers)
    with caplog.at_level(logging.INFO, logger="gpuformers.engine.cuda_graphs"):
        assert decide_cuda_graph(None, model, cuda=True, tp_size=1) is False
    assert f"CUDA graphs off: {blockers[0]}" in caplog.text
    with pytest.raises(ValueError, match=rf"use_cuda_graph=True: {blockers[0]} \(\w*{layer}\) reads which experts"):
        decide_cuda_graph(True, model, cuda=True, tp_size=1)


def test_the_fused_moe_kernel_makes_the_model_capturable():
    pytest.importorskip("triton")
    from gpuformers.kernels.checks import interpreter_on
    from gpuformers.kernels.mapping import kernelize

    if not interpreter_on():
        pytest.skip("kernelize on the CPU needs TRITON_INTERPRET=1")
    model = _model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ValueError, match="load the model with use_kernels=True"):
        decide_cuda_graph(True, model, cuda=True, tp_size=1)
    kernelize(model)
    assert host_syncing_modules(model) == []
    assert decide_cuda_graph(None, model, cuda=True, tp_size=1) is True
