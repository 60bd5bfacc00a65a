"""The Triton FlashAttention kernel against plain torch attention, and the attention backends against each other.

Covers causal (bottom-right aligned, as with a KV cache), grouped-query, sliding window, padding masks, packed
variable-length sequences, sequence lengths of 1 and 17, forward and backward, and a finite-difference gradient check.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.kernels.cases import CASES, DEVICES, assert_close, rand

from gpuformers.kernels.attention import attention_reference, flash_attention  # noqa: E402
from gpuformers.layers.attention import AttentionInterface, build_attention_mask  # noqa: E402

# (q_len, kv_len, heads, kv_heads, causal, window)
SHAPES = {
    "causal-gqa": (17, 17, 4, 2, True, None),
    "full": (17, 17, 2, 2, False, None),
    "window": (17, 17, 2, 1, True, 5),
    "decode": (1, 17, 4, 2, True, None),
    "chunked-prefill-window": (5, 17, 2, 2, True, 7),
}


def _inputs(batch, q_len, kv_len, heads, kv_heads, head_dim, device, dtype):
    q = rand(batch, heads, q_len, head_dim, device=device, dtype=dtype, grad=True, seed=0)
    k = rand(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype, grad=True, seed=1)
    v = rand(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype, grad=True, seed=2)
    return q, k, v


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("case", list(SHAPES))
def test_flash_attention_matches_reference(device, dtype, case):
    q_len, kv_len, heads, kv_heads, causal, window = SHAPES[case]
    q, k, v = _inputs(2, q_len, kv_len, heads, kv_heads, 24, device, dtype)  # head_dim 24: not a power of two
    out = flash_attention(q, k, v, causal=causal, sliding_window=window)
    ref = attention_reference(q, k, v, causal=causal, sliding_window=window)
    assert out.shape == q.shape
    assert_close(out, ref, dtype)
    probe = rand(*out.shape, device=device, dtype=dtype, seed=3)
    got = torch.autograd.grad((out.float() * probe.float()).sum(), (q, k, v))
    want = torch.autograd.grad((ref.float() * probe.float()).sum(), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert_close(g, w, dtype, scale=5 if dtype != torch.float32 else 1), name


@pytest.mark.parametrize("device,dtype", CASES)
def test_padding_mask(device, dtype):
    q, k, v = _inputs(2, 9, 9, 2, 1, 16, device, dtype)
    padding = torch.ones(2, 9, dtype=torch.long, device=device)
    padding[1, :4] = 0  # left padding of the second row
    mask = build_attention_mask(padding, 9, 9, 0)
    out = flash_attention(q, k, v, causal=False, mask=mask)
    ref = attention_reference(q, k, v, causal=False, mask=mask)
    assert_close(out, ref, dtype)
    assert out[1, :, :4].abs().max() == 0  # rows that see no key give zeros, like SDPA
    got = torch.autograd.grad(out.float().sum(), (q, k, v))
    want = torch.autograd.grad(ref.float().sum(), (q, k, v))
    for g, w in zip(got, want):
        assert_close(g, w, dtype, scale=5 if dtype != torch.float32 else 1)


@pytest.mark.parametrize("device,dtype", CASES)
def test_packed_variable_length_sequences(device, dtype):
    lengths, heads, kv_heads, head_dim = [5, 1, 17], 4, 2, 16
    total = sum(lengths)
    q = rand(total, heads, head_dim, device=device, dtype=dtype, grad=True, seed=0)
    k = rand(total, kv_heads, head_dim, device=device, dtype=dtype, grad=True, seed=1)
    v = rand(total, kv_heads, head_dim, device=device, dtype=dtype, grad=True, seed=2)
    cu = torch.tensor([0, 5, 6, 23], dtype=torch.int32, device=device)
    out = flash_attention(q, k, v, causal=True, sliding_window=6, cu_seqlens_q=cu, cu_seqlens_k=cu)
    # Each sequence alone, in the dense layout, must give the same rows: packing never leaks across sequences.
    pieces = []
    for start, n in zip(cu[:-1].tolist(), lengths):
        dense = [t[start:start + n].transpose(0, 1)[None] for t in (q, k, v)]  # (1, heads, n, head_dim)
        pieces.append(attention_reference(*dense, causal=True, sliding_window=6)[0].transpose(0, 1))
    ref = torch.cat(pieces)
    assert_close(out, ref, dtype)
    probe = rand(*out.shape, device=device, dtype=dtype, seed=4)
    got = torch.autograd.grad((out.float() * probe.float()).sum(), (q, k, v))
    want = torch.autograd.grad((ref.float() * probe.float()).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert_close(g, w, dtype, scale=5 if dtype != torch.float32 else 1)


class _Layer(torch.nn.Module):
    """Stands in for the attention module a backend receives (it reads .training)."""


def _backend_inputs(case, device):
    torch.manual_seed(0)
    heads, kv_heads = (4, 2) if case == "gqa" else (2, 2)
    q = torch.randn(2, heads, 11, 16, device=device)
    k = torch.randn(2, kv_heads, 11, 16, device=device)
    v = torch.randn(2, kv_heads, 11, 16, device=device)
    padding = torch.ones(2, 11, dtype=torch.long, device=device)
    window = 4 if case == "sliding-window" else None
    if case == "padded":
        padding[0, :3] = 0
    mask = build_attention_mask(padding, 11, 11, 0, window)
    return q, k, v, mask, window, padding


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["causal", "padded", "gqa", "sliding-window"])
def test_eager_sdpa_and_triton_backends_agree(device, case):
    q, k, v, mask, window, padding = _backend_inputs(case, device)
    outs = {}
    for name in ("eager", "sdpa", "triton"):
        fn = AttentionInterface.get(name)
        out, _ = fn(_Layer().eval(), q, k, v, mask, scaling=16 ** -0.5, sliding_window=window)
        assert out.shape == (2, 11, q.shape[1], 16)
        outs[name] = out[padding.bool()]  # rows of real tokens (pad rows differ by convention between backends)
    torch.testing.assert_close(outs["triton"], outs["sdpa"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["eager"], outs["sdpa"], rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:Input #.*double precision")
def test_triton_backend_gradient_check():
    # Finite differences in float32 (the kernel has no float64): small problem, loose step, tolerances to match.
    q = rand(1, 2, 3, 16, grad=True, seed=0)
    k = rand(1, 1, 3, 16, grad=True, seed=1)
    v = rand(1, 1, 3, 16, grad=True, seed=2)
    backend = AttentionInterface.get("triton")

    def fn(q, k, v):
        return backend(_Layer(), q, k, v, None, scaling=0.25)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-2, atol=5e-3, rtol=5e-3, fast_mode=True)


def test_flash_attention_2_on_cpu_is_a_clear_error():
    backend = AttentionInterface.get("flash_attention_2")
    q = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="flash_attention_2.*needs an NVIDIA GPU.*use attn_implementation='sdpa'"):
        backend(_Layer(), q, q, q, None, scaling=0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_flash_attention_2_runs_or_falls_back_to_triton_once(caplog):
    import importlib.util

    q, k, v = (torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    backend = AttentionInterface.get("flash_attention_2")
    with caplog.at_level(logging.WARNING):
        first, _ = backend(_Layer(), q, k, v, None, scaling=0.125)
        backend(_Layer(), q, k, v, None, scaling=0.125)
    ref, _ = AttentionInterface.get("sdpa")(_Layer(), q, k, v, None, scaling=0.125)
    torch.testing.assert_close(first.float(), ref.float(), rtol=2e-2, atol=2e-2)
    fallbacks = [r for r in caplog.records if "falls back to 'triton'" in r.getMessage()]
    if importlib.util.find_spec("flash_attn") is None:
        assert len(fallbacks) == 1 and "pip install flash-attn" in fallbacks[0].getMessage()


def test_users_register_their_own_backend():
    calls = []

    def mine(module, query, key, value, attention_mask, *, scaling, **kwargs):
        calls.append(query.shape)
        return AttentionInterface.get("sdpa")(module, query, key, value, attention_mask, scaling=scaling)

    AttentionInterface.register("mine-for-test", mine)
    q = torch.randn(1, 2, 3, 16)
    AttentionInterface.get("mine-for-test")(_Layer(), q, q, q, None, scaling=0.25)
    assert calls == [q.shape] and "mine-for-test" in AttentionInterface.names()


def test_launcher_errors_name_the_problem():
    q = torch.randn(1, 3, 4, 16)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
        flash_attention(q, torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor"):
        t = torch.randn(4, 2, 16)
        cu = torch.tensor([0, 4])
        flash_attention(t, t, t, cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.slow  # the first flex_attention call imports torch's compiler stack (several seconds)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_attention_backend_agrees_with_sdpa():
    try:
        flex = AttentionInterface.get("flex_attention")
    except ValueError:
        pytest.skip("this torch has no flex_attention")
    for case in ("causal", "padded", "sliding-window"):
        q, k, v, mask, window, padding = _backend_inputs(case, "cpu")
        got, _ = flex(_Layer(), q, k, v, mask, scaling=0.25, sliding_window=window)
        want, _ = AttentionInterface.get("sdpa")(_Layer(), q, k, v, mask, scaling=0.25, sliding_window=window)
        torch.testing.assert_close(got[padding.bool()], want[padding.bool()], rtol=1e-4, atol=1e-4)
