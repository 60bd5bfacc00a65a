"""SiLU-and-mul (SwiGLU) and SiLU kernels against torch, forward and backward, with rows crossing a block edge."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import CASES, assert_close, rand

from gpuformers.kernels.swiglu import silu, silu_and_mul, swiglu_reference  # noqa: E402


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", [(1, 1, 96), (2, 17, 1100)], ids=["one-token", "17-tokens-wide"])
def test_silu_and_mul(device, dtype, shape):
    gate = rand(*shape, device=device, dtype=dtype, grad=True, seed=0)
    up = rand(*shape, device=device, dtype=dtype, grad=True, seed=1)
    out, ref = silu_and_mul(gate, up), swiglu_reference(gate, up)
    assert_close(out, ref, dtype)
    probe = rand(*shape, device=device, dtype=dtype, seed=2)
    got = torch.autograd.grad((out * probe).sum(), (gate, up))
    want = torch.autograd.grad((ref * probe).sum(), (gate, up))
    for g, w in zip(got, want):
        assert_close(g, w, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_silu(device, dtype):
    x = rand(17, 33, device=device, dtype=dtype, grad=True, seed=0)
    out, ref = silu(x), swiglu_reference(x)
    assert_close(out, ref, dtype)
    assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0], dtype)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match=r"gate \(2, 8\) and up \(2, 9\) must have the same shape"):
        silu_and_mul(torch.randn(2, 8), torch.randn(2, 9))
