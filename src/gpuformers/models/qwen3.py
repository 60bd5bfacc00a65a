"""Qwen3 = the llama decoder + an RMSNorm over each head of q and k before rotary. Only that difference lives here.

Offers: Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM; joint_norm_applies, joint_norm_weight and
norm_and_rotate_jointly (the decode step's q/k norm, models/decode_step.py).
"""

from __future__ import annotations

import torch

from gpuformers.kernels.mapping import active_kernel_functions
from gpuformers.layers.norm import RMSNorm, cpu_rms_norm_applies, cpu_rms_normalize
from gpuformers.layers.rotary import apply_rotary_pos_emb_to
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from gpuformers.models.modeling import plain_calls


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_qk(self, q, k):
        # q, k: (batch, seq, heads, head_dim); the norm runs over head_dim.
        q_norm, k_norm = plain_calls(self, "q_norm", "k_norm")
        return q_norm(q), k_norm(k)

    def position_qk(self, q, k, position_embeddings):
        q_norm, k_norm = plain_calls(self, "q_norm", "k_norm")
        if q.shape[1] == 1 and joint_norm_applies(q_norm, k_norm, q, k):
            weight = joint_norm_weight(q_norm.__self__, k_norm.__self__, q.shape[2], k.shape[2])
            return norm_and_rotate_jointly(q, k, weight, q_norm.__self__.variance_epsilon, position_embeddings)
        return super().position_qk(q, k, position_embeddings)


def joint_norm_applies(q_norm, k_norm, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q_norm and k_norm (from plain_calls) are RMSNorm's own forward, both on its CPU path with one eps,
    and rotary is not routed to a kernel (use_kernels): then norm_and_rotate_jointly gives their numbers."""
    return (getattr(q_norm, "__func__", None) is RMSNorm.forward
            and getattr(k_norm, "__func__", None) is RMSNorm.forward
            and cpu_rms_norm_applies(q, q_norm.__self__.weight) and cpu_rms_norm_applies(k, k_norm.__self__.weight)
            and q_norm.__self__.variance_epsilon == k_norm.__self__.variance_epsilon
            and "rotary_pos_emb" not in active_kernel_functions())


def joint_norm_weight(q_norm: RMSNorm, k_norm: RMSNorm, heads: int, kv_heads: int) -> torch.Tensor:
    """Each head's norm weight, q's heads then k's: (heads + kv_heads, head_dim), for norm_and_rotate_jointly
    (cheaper to build than to multiply two slices in place; a decode step builds it once, models/decode_step.py)."""
    dim = q_norm.weight.shape[-1]
    return torch.cat((q_norm.weight.expand(heads, dim), k_norm.weight.expand(kv_heads, dim)))


def norm_and_rotate_jointly(q, k, weight: torch.Tensor, eps: float, position_embeddings):
    """position_qk for one token per row, q's and k's heads normalised and rotated as one tensor: half the ops of
    two norms and two rotations (a decode step's count), the same numbers, since each head is normalised on its own
    and then multiplied by its own weight (joint_norm_weight), as RMSNorm does.
    q (batch, 1, heads, dim), k (batch, 1, kv_heads, dim)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    qk = cpu_rms_normalize(torch.cat((q, k), dim=2), eps) * weight  # (batch, 1, heads + kv_heads, dim)
    qk = apply_rotary_pos_emb_to(qk, position_embeddings, unsqueeze_dim=2)
    return qk.narrow(2, 0, heads).transpose(1, 2), qk.narrow(2, heads, kv_heads).transpose(1, 2)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer
    no_split_modules = ("Qwen3DecoderLayer",)
