"""RMSNorm and fused residual-add + RMSNorm kernels against the torch reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import CASES, assert_close, rand

from gpuformers.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402  (after the triton skip)


def _grads(out, inputs, seed=1):
    torch.manual_seed(seed)
    outs = out if isinstance(out, tuple) else (out,)
    probes = [torch.randn(o.shape).to(o) for o in outs]
    total = sum((o.float() * p.float()).sum() for o, p in zip(outs, probes))
    return torch.autograd.grad(total, inputs)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", [(1, 1, 37), (2, 17, 64), (17, 100)], ids=["one-token", "17-tokens", "2d"])
def test_rms_norm_forward_backward(device, dtype, shape):
    x = rand(*shape, device=device, dtype=dtype, grad=True, seed=0)
    w = (1 + 0.1 * rand(shape[-1], device=device, dtype=dtype, seed=1)).requires_grad_(True)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)
    for got, want in zip(_grads(out, (x, w)), _grads(ref, (x, w))):
        assert_close(got, want, dtype, scale=4 if dtype != torch.float32 else 1)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_residual_add_rms_norm(device, dtype):
    x = rand(3, 17, 48, device=device, dtype=dtype, grad=True, seed=0)
    residual = rand(3, 17, 48, device=device, dtype=dtype, grad=True, seed=2)
    w = rand(48, device=device, dtype=dtype, grad=True, seed=3)
    y, summed = rms_norm(x, w, 1e-5, residual=residual)
    y_ref, summed_ref = rms_norm_reference(x, w, 1e-5, residual=residual)
    assert_close(summed, summed_ref, dtype)
    assert_close(y, y_ref, dtype)
    # Both outputs carry gradient: the normalised path and the residual stream.
    for got, want in zip(_grads((y, summed), (x, residual, w)), _grads((y_ref, summed_ref), (x, residual, w))):
        assert_close(got, want, dtype, scale=4 if dtype != torch.float32 else 1)


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_permuted_input_forward_backward(device, dtype):
    # (seq, batch, hidden) memory seen as (batch, seq, hidden): dense but not viewable as rows, so the launchers
    # copy it; the residual sum and dx they allocate must still be rows they can view.
    x = rand(5, 2, 16, device=device, dtype=dtype, seed=0).transpose(0, 1).requires_grad_(True)
    residual = rand(5, 2, 16, device=device, dtype=dtype, seed=2).transpose(0, 1).requires_grad_(True)
    w = rand(16, device=device, dtype=dtype, grad=True, seed=3)
    out, ref = rms_norm(x, w, 1e-6, residual=residual), rms_norm_reference(x, w, 1e-6, residual=residual)
    for got, want in zip(out, ref):
        assert_close(got, want, dtype)
    for got, want in zip(_grads(out, (x, residual, w)), _grads(ref, (x, residual, w))):
        assert_close(got, want, dtype)
    y = rms_norm(x, w, 1e-6)
    for got, want in zip(_grads(y, (x, w)), _grads(rms_norm_reference(x, w, 1e-6), (x, w))):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_float32_weight_with_half_input_promotes_like_torch(device, dtype):
    x = rand(2, 5, 24, device=device, dtype=torch.float16)
    w = rand(24, device=device, dtype=torch.float32)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    assert out.dtype == torch.float32
    assert_close(out, ref, torch.float16)


def test_launcher_names_bad_inputs():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight has 7 elements but x has hidden size 8"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rms_norm(torch.randn(8, 2).t(), torch.ones(8))
    with pytest.raises(ValueError, match="dtype int64, which is not one of: float32, float16, bfloat16"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8))
