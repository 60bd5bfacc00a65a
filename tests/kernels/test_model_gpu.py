"""use_kernels on a GPU: a tiny Qwen3 on CUDA gives the same logits, loss and gradients with the Triton kernels
(float32 within 1e-4; float16 and bfloat16 within their rounding). Run by scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def _pair(dtype, attn):
    from gpuformers.kernels.mapping import Mode, kernelize

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY)).to("cuda", dtype).eval()
    fast = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY)).to("cuda", dtype).eval()
    fast.load_state_dict(ref.state_dict())
    fast.set_attn_implementation(attn)
    kernelize(fast, mode=Mode.INFERENCE)
    return ref, fast


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("attn", ["sdpa", "triton"])
def test_logits_with_kernels_on_gpu(dtype, tol, attn):
    ref, fast = _pair(dtype, attn)
    ids = torch.randint(0, TINY["vocab_size"], (2, 33), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits.float()
        got = fast(ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=tol, atol=tol)


def test_training_with_kernels_on_gpu():
    ref, fast = _pair(torch.float32, "triton")
    ref.train()
    fast.train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 33), device="cuda")
    losses = []
    for model in (ref, fast):
        out = model(ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-3, atol=1e-5, msg=name)
