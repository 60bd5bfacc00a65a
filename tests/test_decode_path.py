"""Every decode step goes through nn.Module.__call__: module hooks (device_map, tensor parallelism, FSDP2, a user's)
run at every step, global hooks see every call, and the numbers are those of the hook-free run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM

TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(request.param, **TINY), dtype="float32").eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _decode_logits(model):
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def test_module_hooks_run_in_decode_steps(model):
    want_seq, want = _decode_logits(model)
    calls = []
    attn = model.model.layers[1].self_attn
    handles = [attn.q_proj.register_forward_hook(lambda m, a, o: calls.append("q_proj")),
               model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append("mlp")),
               model.model.layers[0].register_forward_hook(lambda m, a, o: calls.append("layer"))]
    if hasattr(attn, "q_norm"):
        handles.append(attn.q_norm.register_forward_hook(lambda m, a, o: calls.append("q_norm")))
    try:
        seq, got = _decode_logits(model)
    finally:
        for h in handles:
            h.remove()
    forwards = 5  # prefill + 4 decode steps
    for name in ("q_proj", "mlp", "layer") + (("q_norm",) if hasattr(attn, "q_norm") else ()):
        assert calls.count(name) == forwards, name
    assert torch.equal(seq, want_seq) and torch.equal(got, want)  # the plain path gives the same numbers


def test_global_hook_sees_every_call_and_numbers_match(model):
    want_seq, want = _decode_logits(model)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        seq, got = _decode_logits(model)
    finally:
        handle.remove()
    assert seen.count("Linear") == 5 * (7 * TINY["num_hidden_layers"] + 1)
    assert torch.equal(seq, want_seq) and torch.equal(got, want)


def test_a_hook_that_changes_outputs_is_applied(model):
    _, want = _decode_logits(model)
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, o: o * 0)
    try:
        _, got = _decode_logits(model)
    finally:
        handle.remove()
    assert not torch.equal(got[1:], want[1:])  # decode steps too


def test_a_hook_registered_between_two_generate_calls_runs_in_every_step_of_the_next(model):
    mlp = model.model.layers[0].mlp
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, eos_token_id=None)
    calls = []
    handle = mlp.register_forward_pre_hook(lambda m, a: calls.append("mlp"))
    try:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, eos_token_id=None)
    finally:
        handle.remove()
    assert len(calls) == 3  # a hook registered between two generate() calls runs in every step of the next
