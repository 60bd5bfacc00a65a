"""The flex_attention backend (layers/flash_attention.py) builds one block mask per forward, not one per layer, never
reuses a block mask for a different mask or shape, keeps no forward's mask alive, and on CUDA runs the compiled
flex_attention with sdpa's numbers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import gpuformers.layers.flash_attention as flash
from gpuformers.layers.attention import AttentionInterface, build_attention_mask
from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch: flex_attention uncompiled on the CPU

TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
# layer 0 full attention, layers 1 and 2 a window of 4: two distinct masks per forward
WINDOWED = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)


def _model(model_type: str = "llama", **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **overrides}),
                                            dtype="float32").eval()


def _inputs(seq: int, pads: tuple[int, int], device="cpu"):
    ids = torch.randint(0, TINY["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seq))
    padding = torch.ones(2, seq, dtype=torch.long)
    for row, n in enumerate(pads):
        padding[row, :n] = 0  # left padding
    return ids.to(device), padding.to(device)


def _logits(model, backend, ids, padding):
    model.set_attn_implementation(backend)
    with torch.no_grad():
        return model(ids, attention_mask=padding).logits


@pytest.fixture
def block_mask_builds(monkeypatch):
    """The shapes create_block_mask is asked for, from an empty block-mask cache."""
    import torch.nn.attention.flex_attention as torch_flex

    try:
        AttentionInterface.get("flex_attention")
    except ValueError:
        pytest.skip("this torch has no flex_attention")
    calls = []
    real = torch_flex.create_block_mask

    def spy(mask_mod, B, H, Q_LEN, KV_LEN, *args, **kwargs):
        calls.append((B, Q_LEN, KV_LEN))
        return real(mask_mod, B, H, Q_LEN, KV_LEN, *args, **kwargs)

    monkeypatch.setattr(torch_flex, "create_block_mask", spy)
    flash._block_masks.clear()
    yield calls
    flash._block_masks.clear()


@pytest.mark.parametrize("case", ["llama-padded", "llama-unpadded", "qwen2-two-windows"])
def test_block_mask_is_built_once_per_forward(block_mask_builds, case):
    model = _model("qwen2", **WINDOWED) if case.startswith("qwen2") else _model()
    ids, padding = _inputs(9, (3, 0) if case != "llama-unpadded" else (0, 0))
    want = _logits(model, "sdpa", ids, padding)
    got = _logits(model, "flex_attention", ids, padding)
    distinct_masks = 2 if case.startswith("qwen2") else 1
    assert len(block_mask_builds) == distinct_masks  # not one per layer (3)
    real = padding.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_a_changed_mask_or_shape_gets_a_new_block_mask(block_mask_builds):
    model = _model()
    forwards = [(9, (3, 0)), (9, (0, 5)), (9, (0, 5)), (12, (0, 5)), (12, (0, 0)), (12, (0, 0)), (7, (0, 0))]
    for i, (seq, pads) in enumerate(forwards):
        ids, padding = _inputs(seq, pads)
        want = _logits(model, "sdpa", ids, padding)
        got = _logits(model, "flex_attention", ids, padding)
        real = padding.bool()
        torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4, msg=f"forward {i}: {seq}, {pads}")
    # Every padded forward has a mask tensor of its own: a new block mask each. Unpadded, the block mask is plain
    # causal, a function of its shape: built once for (2, 12, 12), again for (2, 7, 7).
    assert block_mask_builds == [(2, 9, 9), (2, 9, 9), (2, 9, 9), (2, 12, 12), (2, 12, 12), (2, 7, 7)]


def test_a_mask_changed_in_place_gets_a_new_block_mask(block_mask_builds):
    flex, sdpa = AttentionInterface.get("flex_attention"), AttentionInterface.get("sdpa")
    layer = torch.nn.Module().eval()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 11, 16) for _ in range(3))
    mask = torch.ones(2, 1, 11, 11, dtype=torch.bool).tril()  # causal, no padding
    flex(layer, q, k, v, mask, scaling=0.25)
    mask[0, :, :, :4] = False  # row 0 now left-padded by 4
    got, _ = flex(layer, q, k, v, mask, scaling=0.25)
    want, _ = sdpa(layer, q, k, v, mask, scaling=0.25)
    assert len(block_mask_builds) == 2
    torch.testing.assert_close(got[0, 4:], want[0, 4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_the_block_mask_cache_keeps_no_mask_alive(block_mask_builds):
    flex = AttentionInterface.get("flex_attention")
    q = torch.randn(2, 2, 11, 16)
    padding = torch.ones(2, 11, dtype=torch.long)
    padding[0, :3] = 0
    mask = build_attention_mask(padding, 11, 11, 0)
    flex(torch.nn.Module().eval(), q, q, q, mask, scaling=0.25)
    assert len(flash._block_masks) == 1
    dead = weakref.ref(mask)
    del mask
    gc.collect()
    assert dead() is None and len(flash._block_masks) == 0


def test_generate_with_flex_attention_matches_sdpa(block_mask_builds):
    # generate() runs under inference mode: its masks are inference tensors, which keep no version counter
    model = _model()
    ids, padding = _inputs(9, (3, 0))
    out = {}
    for backend in ("sdpa", "flex_attention"):
        model.set_attn_implementation(backend)
        out[backend] = model.generate(ids, attention_mask=padding, max_new_tokens=6, do_sample=False,
                                      eos_token_id=None)
    assert torch.equal(out["flex_attention"], out["sdpa"])
    assert len(block_mask_builds) == 6  # one per forward: the prefill and 5 decode steps, not one per layer

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_flex_attention_on_cuda_is_compiled_and_matches_sdpa(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    model = _model(max_position_embeddings=256).to("cuda", torch.bfloat16)
    compiled, _ = flash._flex_functions(torch.device("cuda"))
    assert compiled is not torch_flex_attention
    assert getattr(compiled, "_torchdynamo_orig_callable", None) is torch_flex_attention
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return compiled(*args, **kwargs)

    monkeypatch.setattr(flash, "_compiled_flex_attention", counted)
    for seq, pads in ((9, (3, 0)), (140, (0, 0)), (140, (0, 37))):  # 140: more than one 128-wide block
        calls.clear()
        ids, padding = _inputs(seq, pads, "cuda")
        want = _logits(model, "sdpa", ids, padding).float()
        got = _logits(model, "flex_attention", ids, padding).float()
        assert len(calls) == TINY["num_hidden_layers"], (seq, pads)
        real = padding.bool()
        torch.testing.assert_close(got[real], want[real], rtol=3e-2, atol=3e-2, msg=f"{seq}, {pads}")
