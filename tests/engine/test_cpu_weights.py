"""The engine's oneDNN-packed linear weights on the CPU (engine/cpu_weights.py): the same numbers as F.linear up to
rounding, the same greedy tokens as generate(), the model untouched outside a step, weights changed between steps
repacked, and the automatic decision (on for float32 on the CPU while the copies fit; refused by name elsewhere)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuformers.engine import config as engine_config
from gpuformers.engine import cpu_weights
from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.cpu_weights import PACKED_ROWS, PackedLinears, packable_linears, prepack_available
from gpuformers.engine.manager import ContinuousBatchingManager
from tests.engine.test_engine import NEW_TOKENS, greedy_reference, make_prompts, tiny_model

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")


def test_packed_linear_equals_f_linear_and_leaves_other_row_counts_to_it():
    layer = torch.nn.Linear(64, 96, bias=True)
    packed = PackedLinears(layer)
    with torch.inference_mode(), packed.active():
        for rows in (1, 3, 4, 17, 192, 193, 300):
            x = torch.randn(1, rows, 64)
            got, want = layer(x), F.linear(x, layer.weight, layer.bias)
            assert got.shape == want.shape == (1, rows, 96)
            if rows in PACKED_ROWS:
                assert (got - want).abs().max() < 1e-5  # another summation order
            else:
                assert torch.equal(got, want)  # F.linear itself
    with torch.enable_grad(), packed.active():  # a call that records a backward stays on F.linear
        x = torch.randn(8, 64, requires_grad=True)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("model_type, overrides", [("qwen3", {}), ("qwen2", {"qkv_bias": True})])
def test_engine_tokens_equal_generate_with_packed_weights_and_the_model_is_left_as_it_was(monkeypatch, model_type,
                                                                                         overrides):
    model = tiny_model(model_type, **overrides)
    prompts = make_prompts(24)
    expected = greedy_reference(model, prompts)
    manager = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(
        prepack_weights=True))
    groups = [[layer for layer in group.layers] for group in manager.runner.packed.groups]
    assert sorted(id(layer) for group in groups for layer in group) == sorted(map(id, packable_linears(model)))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert [attention.q_proj, attention.k_proj, attention.v_proj] in groups  # siblings share one matmul
    assert [mlp.gate_proj, mlp.up_proj] in groups and [mlp.down_proj] in groups
    assert "prepacked linear weights" in manager.memory_summary()
    rows_seen = []
    packed_forward = cpu_weights._PackedGroup.forward

    def spy(self, index, x):
        rows_seen.append(x.numel() // x.shape[-1])
        return packed_forward(self, index, x)

    monkeypatch.setattr(cpu_weights._PackedGroup, "forward", spy)
    ids = [manager.add_request(p, max_new_tokens=10) for p in prompts]
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in ids] == expected
    assert any(rows in PACKED_ROWS for rows in rows_seen)  # the packed path did run
    assert not any("forward" in layer.__dict__ for layer in packable_linears(model))
    assert all(group.last_input is None for group in manager.runner.packed.groups)  # no activations kept


def test_a_weight_changed_between_steps_is_packed_again():
    model = tiny_model()
    prompts = make_prompts(8, seed=3)
    manager = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(
        prepack_weights=True))
    ids = [manager.add_request(p, max_new_tokens=4) for p in prompts]
    manager.run_until_done()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(3.0)  # in place: the same storage, a new version
            layer.self_attn.k_proj.weight.mul_(-2.0)  # one layer of a sibling group
        model.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(
            model.model.layers[0].self_attn.o_proj.weight.flip(0).clone())  # a new storage
    expected = greedy_reference(model, prompts, new_tokens=6)
    ids = [manager.add_request(p, max_new_tokens=6) for p in prompts]
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in ids] == expected


def test_weights_made_in_inference_mode():
    with torch.inference_mode():  # weights without a version counter, as a loader in inference mode leaves them
        model = tiny_model()
    prompts = make_prompts(6, seed=5)
    expected = greedy_reference(model, prompts)
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, progress_bar=False, prepack_weights=True)
    assert [r.generated_tokens for r in out.values()] == expected


def test_automatic_decision():
    model = tiny_model()
    assert ContinuousBatchingConfig().resolve(model).prepack_weights is True
    assert ContinuousBatchingConfig(prepack_weights=False).resolve(model).prepack_weights is False
    half = tiny_model().to(torch.bfloat16)
    assert ContinuousBatchingConfig().resolve(half).prepack_weights is False
    with pytest.raises(ValueError, match="prepack_weights=True: the model has no float32 nn.Linear"):
        ContinuousBatchingConfig(prepack_weights=True).resolve(half)


def test_automatic_decision_leaves_them_out_when_memory_is_short(monkeypatch):
    model = tiny_model()
    linear_bytes = sum(layer.weight.numel() * 4 for layer in packable_linears(model))
    monkeypatch.setattr(engine_config, "free_memory", lambda device, cap=True: 3 * linear_bytes)
    assert ContinuousBatchingConfig().resolve(model).prepack_weights is False
    assert ContinuousBatchingConfig(prepack_weights=True, num_blocks=8).resolve(model).prepack_weights is True
