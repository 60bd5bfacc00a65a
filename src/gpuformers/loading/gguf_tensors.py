"""A GGUF file's tensors in HF terms: llama.cpp's tensor names -> HF parameter names per architecture, which ggml
types the installed `gguf` package can dequantize, and llama's q/k row order turned back into HF's.

Offers: `supported_quant_types()`, and to gguf.py the name tables (`LAYER_NAMES`, `EXTRA_LAYER_NAMES`,
`EXPERT_NAMES`, `NOT_PARAMETERS`), `hf_parameter_name`, `can_dequantize`, `ROTARY_PERMUTED` and
`unpermute_rotary_rows`.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import torch

# llama.cpp's converter reorders q/k rows for llama only; it writes the others in HF order.
ROTARY_PERMUTED = ("llama",)

# llama.cpp block name -> HF module name inside model.layers.{i}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# What each architecture adds to (or renames in) LAYER_NAMES.
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # per-head RMSNorm on q, k
_GEMMA_NORMS = {  # Gemma 2 / 3 norm both sides of attention and MLP; llama.cpp's ffn_norm is the pre-MLP one
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
EXTRA_LAYER_NAMES = {
    "qwen3": _QK_NORMS,
    "qwen3moe": _QK_NORMS | {"ffn_gate_inp": "mlp.gate"},  # the router
    "qwen2moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                 "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                 "ffn_gate_inp_shexp": "mlp.shared_expert_gate"},  # the router, the shared expert and its gate
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused, in HF's order
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS | _QK_NORMS,
}
# Stacked experts, (experts, rows, cols) in torch order -> the per-expert module inside mlp.experts.{e}
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors with no HF parameter: rope_freqs (Llama 3) and rope_factors_long/short (Phi-3 longrope) become
# config.rope_scaling, attn_rot_embd is an old cache.
NOT_PARAMETERS = re.compile(r"rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd\.weight")


@functools.cache
def can_dequantize(qtype: int) -> bool:
    """Whether the installed `gguf` package dequantizes this ggml type (probed on one zero block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(qtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return True
    if qtype not in GGML_QUANT_SIZES:
        return False
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
    except Exception:  # NotImplementedError, or a type whose helper tables are missing in this version
        return False
    return True


def supported_quant_types() -> list[str]:
    """Names of the ggml tensor types the installed `gguf` package can dequantize (F32, F16, Q4_K, ...)."""
    from gguf import GGMLQuantizationType

    return [t.name for t in GGMLQuantizationType if can_dequantize(int(t))]


def hf_parameter_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    """llama.cpp tensor name -> HF parameter name, or None when neither `layer_names` (llama.cpp block name ->
    HF module) nor the top-level names have a place for it."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{suffix}"
    return None


def unpermute_rotary_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves, HF keeps them apart.

    A head's rows in HF order are [x0 .. x(h-1) | y0 .. y(h-1)] (h = head_dim/2, rotated as pairs (xi, yi));
    llama.cpp stores them as [x0 y0 x1 y1 ...]. Rows are whole, so this works after dequantizing.
    """
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    # (heads, half, 2, ...) in file order -> (heads, 2, half, ...) in HF order
    return tensor.reshape(num_heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
