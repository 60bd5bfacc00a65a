"""attn_implementation="flash_attention_4" (FlashAttention CuTe, `flash_attn.cute`): registered beside FA2/FA3, an
error on the CPU, a fallback to "triton" naming why without the package or on a GPU it does not support, and, with
a stand-in `flash_attn.cute` module (the real one needs a Hopper or Blackwell GPU), the arguments the backend hands
it: (batch, seq, heads, head_dim) layout, bottom-right causality, the window, the soft-cap and grouped-query heads."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest
import torch

from gpuformers.layers import flash_attention
from gpuformers.layers.attention import AttentionInterface, build_attention_mask, eager_attention


def _fake_flash_attn_cute(calls: list) -> dict[str, types.ModuleType]:
    """flash_attn and flash_attn.cute modules whose flash_attn_func records its arguments and computes attention
    in float32 as FlashAttention defines it (independently of our backends): causal aligned bottom-right, a window
    (left, right) of keys around each query (None: unbounded), softcap * tanh(scores / softcap), kv heads shared by
    heads / kv_heads query heads."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, **rest):
        calls.append(dict(q=q.shape, k=k.shape, v=v.shape, scale=softmax_scale, causal=causal, window=window_size,
                          softcap=softcap, rest=rest, dtype=q.dtype))
        batch, q_len, heads, dim = q.shape
        kv_len, kv_heads = k.shape[1], k.shape[2]
        k = k.float().repeat_interleave(heads // kv_heads, dim=2)
        v = v.float().repeat_interleave(heads // kv_heads, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * softmax_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        diagonal = torch.arange(q_len)[:, None] + (kv_len - q_len)  # query i's own key, bottom-right aligned
        keys = torch.arange(kv_len)[None, :]
        left, right = window_size
        right = 0 if causal else right
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
        if right is not None:
            allowed &= keys <= diagonal + right
        if left is not None:
            allowed &= keys >= diagonal - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).to(q.dtype)
        return out, None  # FlashAttention-4 returns (out, lse)

    parent = types.ModuleType("flash_attn")
    parent.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    parent.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    cute.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute", None)
    cute.flash_attn_func = flash_attn_func
    parent.cute = cute
    return {"flash_attn": parent, "flash_attn.cute": cute}


@pytest.fixture
def on_a_gpu_of(monkeypatch):
    """Make the backend believe the tensors sit on a GPU of the given compute capability (the CPU tensors stay)."""
    monkeypatch.setattr(flash_attention, "_usable", {})
    monkeypatch.setattr(flash_attention, "_warned", set())
    monkeypatch.setattr(flash_attention, "check_backend_device", lambda name, device: None)

    def set_capability(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return set_capability


@pytest.fixture
def fake_fa4(monkeypatch):
    calls = []
    for name, module in _fake_flash_attn_cute(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _qkv(q_len, kv_len, heads=4, kv_heads=2, dtype=torch.float16):
    torch.manual_seed(0)
    return (torch.randn(2, heads, q_len, 16, dtype=dtype), torch.randn(2, kv_heads, kv_len, 16, dtype=dtype),
            torch.randn(2, kv_heads, kv_len, 16, dtype=dtype))


def test_flash_attention_4_is_registered_and_an_error_on_the_cpu():
    assert "flash_attention_4" in AttentionInterface.names()
    q = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="flash_attention_4.*needs an NVIDIA GPU.*use attn_implementation='sdpa'"):
        AttentionInterface.get("flash_attention_4")(torch.nn.Module(), q, q, q, None, scaling=0.25)


def test_why_it_cannot_run_names_the_package_and_the_gpu(monkeypatch, fake_fa4):
    assert flash_attention.flash_attn_usable("flash_attention_4", (9, 0)) == ""
    assert flash_attention.flash_attn_usable("flash_attention_4", (10, 0)) == ""
    why = flash_attention.flash_attn_usable("flash_attention_4", (8, 0))
    assert "needs a Hopper or Blackwell GPU" in why and "this one is 8.0" in why
    assert "this one is 12.0" in flash_attention.flash_attn_usable("flash_attention_4", (12, 0))
    assert "there is none" in flash_attention.flash_attn_usable("flash_attention_4", None)
    monkeypatch.delitem(sys.modules, "flash_attn.cute")
    monkeypatch.delitem(sys.modules, "flash_attn")
    monkeypatch.setattr(sys, "path", [])  # nothing importable: the package is "not installed"
    why = flash_attention.flash_attn_usable("flash_attention_4", (9, 0))
    assert "flash_attn.cute package is not installed" in why and "flash_attn/cute" in why


def test_without_the_package_it_falls_back_to_triton_once_naming_why(monkeypatch, on_a_gpu_of, caplog):
    on_a_gpu_of((9, 0))
    monkeypatch.setattr(flash_attention, "_installed", lambda module: False)
    q, k, v = _qkv(7, 7, dtype=torch.float32)
    with caplog.at_level(logging.WARNING):
        out, _ = flash_attention.flash_attention_4(torch.nn.Module(), q, k, v, None, scaling=0.25)
        flash_attention.flash_attention_4(torch.nn.Module(), q, k, v, None, scaling=0.25)
    warnings = [r.getMessage() for r in caplog.records if "falls back to 'triton'" in r.getMessage()]
    assert len(warnings) == 1 and "flash_attention_4" in warnings[0] and "flash_attn.cute" in warnings[0]
    want, _ = eager_attention(torch.nn.Module(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# (q_len, kv_len, heads, kv_heads, window, softcap, expected causal, expected window_size)
ROUTES = {
    "prefill-gqa": (9, 9, 4, 2, None, None, True, (None, None)),
    "decode-after-cache": (1, 9, 4, 1, None, None, False, (None, None)),
    "chunk-after-cache-window": (4, 11, 4, 2, 5, None, True, (4, 0)),
    "softcap": (9, 9, 2, 2, None, 30.0, True, (None, None)),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_the_registry_routes_to_flash_attn_cute_with_the_right_arguments(case, on_a_gpu_of, fake_fa4):
    q_len, kv_len, heads, kv_heads, window, softcap, causal, window_size = ROUTES[case]
    on_a_gpu_of((9, 0))
    q, k, v = _qkv(q_len, kv_len, heads, kv_heads)
    backend = AttentionInterface.get("flash_attention_4")
    out, weights = backend(torch.nn.Module(), q, k, v, None, scaling=0.25, sliding_window=window, softcap=softcap)
    assert len(fake_fa4) == 1
    call = fake_fa4[0]
    assert call["q"] == (2, q_len, heads, 16) and call["k"] == call["v"] == (2, kv_len, kv_heads, 16)
    assert (call["scale"], call["causal"], call["window"]) == (0.25, causal, window_size)
    assert call["softcap"] == (softcap or 0.0) and call["dtype"] == torch.float16
    # The same numbers as eager with the mask our models build (causal from the end of the cache, the window)
    mask = build_attention_mask(None, q_len, kv_len, kv_len - q_len, window)
    want, _ = eager_attention(torch.nn.Module(), q.float(), k.float(), v.float(), mask, scaling=0.25,
                              softcap=softcap)
    assert out.shape == (2, q_len, heads, 16) and weights is None
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


def test_padding_masks_and_float32_stay_off_flash_attn(on_a_gpu_of, fake_fa4):
    """flash-attn takes no boolean mask and no float32: those calls go to the triton kernel, same numbers."""
    on_a_gpu_of((10, 0))
    backend = AttentionInterface.get("flash_attention_4")
    q, k, v = _qkv(6, 6, dtype=torch.float32)
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[0, :2] = 0
    mask = build_attention_mask(padding, 6, 6, 0)
    out, _ = backend(torch.nn.Module(), q, k, v, mask, scaling=0.25)
    backend(torch.nn.Module(), q, k, v, None, scaling=0.25)
    want, _ = AttentionInterface.get("sdpa")(torch.nn.Module(), q, k, v, mask, scaling=0.25)
    assert fake_fa4 == []
    torch.testing.assert_close(out[1], want[1], atol=1e-5, rtol=1e-5)  # row 0's first queries see nothing


def test_a_soft_capped_fallback_keeps_the_cap(monkeypatch, on_a_gpu_of):
    """The triton kernel has no soft-cap: a soft-capped call that cannot use flash_attn.cute runs eager."""
    on_a_gpu_of((8, 0))  # too old for FlashAttention-4
    q, k, v = _qkv(5, 5, dtype=torch.float32)
    out, _ = flash_attention.flash_attention_4(torch.nn.Module(), q, k, v, None, scaling=0.25, softcap=2.0,
                                               sliding_window=3)
    mask = build_attention_mask(None, 5, 5, 0, 3)
    want, _ = eager_attention(torch.nn.Module(), q, k, v, mask, scaling=0.25, softcap=2.0)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_a_model_on_the_cpu_refuses_flash_attention_4_at_load(tmp_path):
    from tests.fixtures.checkpoints import make_checkpoint

    from gpuformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="flash_attention_4.*needs an NVIDIA GPU"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flash_attention_4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_flash_attention_4_on_the_gpu_matches_sdpa_or_says_why_not(monkeypatch, caplog):
    """On a Hopper or Blackwell GPU with flash_attn.cute installed: the real kernel, causal GQA and a window, equal to
    sdpa in bfloat16; elsewhere the one fallback warning names the reason (and the triton numbers are the same)."""
    monkeypatch.setattr(flash_attention, "_warned", set())
    torch.manual_seed(0)
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    backend = AttentionInterface.get("flash_attention_4")
    for window in (None, 33):
        with caplog.at_level(logging.WARNING):
            out, _ = backend(torch.nn.Module(), q, k, v, None, scaling=0.125, sliding_window=window)
        mask = build_attention_mask(None, 128, 128, 0, window, device="cuda")
        want, _ = AttentionInterface.get("sdpa")(torch.nn.Module(), q, k, v, mask, scaling=0.125)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    why = flash_attention.flash_attn_usable("flash_attention_4", torch.cuda.get_device_capability())
    fallbacks = [r.getMessage() for r in caplog.records if "falls back to 'triton'" in r.getMessage()]
    assert (len(fallbacks) == 1 and why in fallbacks[0]) if why else not fallbacks


def test_the_engine_prefills_through_flash_attn_varlen_func_over_its_pages(monkeypatch, fake_fa4):
    """A model loaded with flash_attention_4 runs the engine as "paged|flash_attention_4": its prefill chunks go to
    FlashAttention-4's varlen entry point with the cache as pages (num_blocks, block_size, kv_heads, head_dim), the
    block tables as page_table and the keys per sequence as seqused_k (int32), causal; the tokens equal generate()'s.
    The stand-in computes the paged attention in torch (a GPU with paged FA4, Blackwell, is faked)."""
    from gpuformers.engine import paged_attention
    from tests.engine.test_engine import greedy_reference, tiny_model

    varlen_calls = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, max_seqlen_q=None, seqused_k=None, page_table=None,
                               softmax_scale=None, causal=False, window_size=(None, None), **rest):
        varlen_calls.append(dict(q=q.shape, pages=k.shape, cu=cu_seqlens_q.tolist(), max_q=max_seqlen_q,
                                 used=seqused_k.tolist(), table=(page_table.dtype, seqused_k.dtype, page_table.shape),
                                 causal=causal, window=window_size, rest=rest))
        heads, kv_heads, block_size = q.shape[1], k.shape[2], k.shape[1]
        out = torch.empty_like(q)
        for i, used in enumerate(seqused_k.tolist()):
            start, end = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
            blocks = page_table[i, :(used + block_size - 1) // block_size]
            keys = k[blocks].reshape(-1, kv_heads, k.shape[-1])[:used].repeat_interleave(heads // kv_heads, 1)
            values = v[blocks].reshape(-1, kv_heads, v.shape[-1])[:used].repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * softmax_scale
            visible = torch.ones(end - start, used, dtype=torch.bool).tril(used - (end - start))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                          values)
        return out, None

    sys.modules["flash_attn.cute"].flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setattr(paged_attention, "fa4_pages_kv", lambda query: True)
    model = tiny_model()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 3, 17)]
    reference = greedy_reference(model, prompts, new_tokens=6)
    model.set_attn_implementation("flash_attention_4")
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=16, max_batch_tokens=12)
    assert model.attn_implementation == "paged|flash_attention_4"
    ids = [manager.add_request(p, max_new_tokens=6) for p in prompts]
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in ids] == reference
    assert varlen_calls, "no prefill went through flash_attn_varlen_func"
    first = varlen_calls[0]
    heads, kv_heads, head_dim = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    assert first["pages"][1:] == (8, kv_heads, head_dim) and first["q"][1:] == (heads, head_dim)  # 8: block_size
    assert first["table"][:2] == (torch.int32, torch.int32) and first["causal"] is True
    assert first["window"] == (None, None) and first["rest"] == {}
    assert all(call["cu"][-1] == call["q"][0] and call["max_q"] <= 12 for call in varlen_calls)
    # a chunk after cached keys: some sequence saw more keys than it brought queries (chunked prefill)
    assert any(used > cu[i + 1] - cu[i] for call in varlen_calls for cu in [call["cu"]]
               for i, used in enumerate(call["used"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("window", [None, 7])
def test_flash_attention_4_paged_prefill_on_the_gpu_matches_the_reference(window):
    """The real FlashAttention-4 varlen call over a paged cache, where it reads paged KV (Blackwell), against the
    engine's torch reference for paged prefill."""
    from gpuformers.engine.paged_attention_triton import paged_prefill_reference
    from tests.engine.test_paged_prefill_triton import prefill_case

    query, key_cache, value_cache, tables, cu, lengths, block_size = prefill_case(
        [5, 1, 17], [9, 30, 0], heads=8, kv_heads=2, head_dim=64, block_size=128 // 8, dtype=torch.bfloat16)
    if not flash_attention.fa4_pages_kv(query):
        pytest.skip("FlashAttention-4 with paged KV is not available here (package, or a GPU before Blackwell)")
    out = flash_attention.flash_attention_4_paged_prefill(query, key_cache, value_cache, tables, cu, lengths,
                                                          block_size, 0.125, 17, window)
    want = paged_prefill_reference(query.float(), key_cache.float(), value_cache.float(), tables, cu, lengths,
                                   block_size, 0.125, window)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
