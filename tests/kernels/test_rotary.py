"""The rotary kernel against layers/rotary.py: out of place with a backward, in place, both head layouts."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import CASES, assert_close, rand

from gpuformers.kernels.rotary import apply_rotary, apply_rotary_inplace  # noqa: E402
from gpuformers.layers.rotary import apply_rotary_pos_emb  # noqa: E402

rotary_reference = apply_rotary_pos_emb.torch_function  # the torch computation the kernel replaces


def _cos_sin(batch, seq, head_dim, device, dtype):
    # Like RotaryEmbedding: the two halves repeat the same frequencies; positions differ per batch row.
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.arange(seq)[None].float() + torch.arange(batch)[:, None] * 3
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("seq", [1, 17])
def test_rotary_forward_backward(device, dtype, seq):
    batch, heads, kv_heads, head_dim = 2, 3, 1, 20
    # q as the model makes it: a transposed view of (batch, seq, heads, head_dim).
    q = rand(batch, seq, heads, head_dim, device=device, dtype=dtype, seed=0).transpose(1, 2).requires_grad_(True)
    k = rand(batch, kv_heads, seq, head_dim, device=device, dtype=dtype, grad=True, seed=1)
    cos, sin = _cos_sin(batch, seq, head_dim, device, dtype)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    q_ref, k_ref = rotary_reference(q, k, cos, sin)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    dq = rand(*q_out.shape, device=device, dtype=dtype, seed=2)
    dk = rand(*k_out.shape, device=device, dtype=dtype, seed=3)
    got = torch.autograd.grad((q_out * dq).sum() + (k_out * dk).sum(), (q, k))
    want = torch.autograd.grad((q_ref * dq).sum() + (k_ref * dk).sum(), (q, k))
    for g, w in zip(got, want):
        assert_close(g, w, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_rotary_in_place_and_seq_major_layout(device, dtype):
    batch, seq, heads, head_dim = 1, 17, 4, 16
    cos, sin = _cos_sin(batch, seq, head_dim, device, dtype)
    # unsqueeze_dim=2: q and k are (batch, seq, heads, head_dim)
    q = rand(batch, seq, heads, head_dim, device=device, dtype=dtype, seed=0)
    k = rand(batch, seq, 2, head_dim, device=device, dtype=dtype, seed=1)
    q_ref, k_ref = rotary_reference(q, k, cos, sin, unsqueeze_dim=2)
    q_out, k_out = apply_rotary_inplace(q, k, cos, sin, unsqueeze_dim=2)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # really in place
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)


def test_rotary_checks_shapes():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cos = sin = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=r"cos/sin \(1, 4, 8\) do not match x \(batch=1, seq=5, head_dim=8\)"):
        apply_rotary(q, k, cos, sin)
    with pytest.raises(ValueError, match="even head_dim"):
        apply_rotary(torch.randn(1, 2, 5, 7), torch.randn(1, 2, 5, 7), torch.randn(1, 5, 7), torch.randn(1, 5, 7))
