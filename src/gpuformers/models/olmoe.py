"""AllenAI OLMoE (OLMoE-1B-7B-0924 and -Instruct) = the llama pre-norm decoder with OLMo 2's q/k norm over the whole
projection and a sparse mixture-of-experts block (layers/moe.py) in place of every MLP. Only those differences live
here.

    attention: q = q_norm(q_proj(h)), k = k_norm(k_proj(h)), each an RMSNorm over all heads at once, before the
               split into heads and rotary; llama's RMSNorm rounding (cast back, then the weight), not OLMo 2's;
               with clip_qkv set, q and k (after their norms) and v clamped to [-clip_qkv, clip_qkv]
    mlp:       every layer sparse: softmax router over num_experts, top num_experts_per_tok (renormalised only
               when norm_topk_prob, default off), each expert a gated MLP of intermediate_size; no shared expert

No sliding window, no dense layers. Checkpoint keys are what the Hub holds and transformers' save_pretrained writes
by default (mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj.weight; transformers' fused layout, mlp.experts.
gate_up_proj / down_proj, loads too, through Qwen3-MoE's checkpoint_fan_out), so the block is Qwen3-MoE's, with
its fused kernel under use_kernels=True; router logits and the aux loss (output_router_logits,
router_aux_loss_coef, default 0.01) are Qwen3-MoE's forward, which this model inherits: transformers computes both
families' aux loss with the same function.

transformers sizes q_norm by hidden_size: a config whose head_dim is not hidden_size / num_attention_heads is
refused, as transformers could not build it. tp_plan="auto" is refused: q_norm / k_norm reduce over every head,
which the llama plan splits across processes (transformers gathers q/k/v there, a style we do not have).

Offers: OlmoeConfig, OlmoeAttention, OlmoeDecoderLayer, OlmoeForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuformers.layers.moe import SparseMoeBlock
from gpuformers.layers.norm import RMSNorm
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaDecoderLayer
from gpuformers.models.olmo2 import Olmo2Attention
from gpuformers.models.qwen3_moe import Qwen3MoeForCausalLM


@dataclass
class OlmoeConfig(ModelConfig):
    """transformers' OlmoeConfig defaults, with the MoE fields and clip_qkv."""

    family_defaults = {"olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "pad_token_id": 1,
                                 "eos_token_id": 50279}}

    clip_qkv: float | None = None  # None: no clipping
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    absent_fields = ("head_dim", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                     "layer_types")

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "num_local_experts" in data:  # transformers' other name for num_experts (OlmoeConfig.attribute_map)
            data.setdefault("num_experts", data.pop("num_local_experts"))
        return super()._prepare_dict(data)

    def _check_family(self) -> None:
        super()._check_family()
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"OLMoE's q_norm spans hidden_size ({self.hidden_size}), so head_dim must be "
                             f"hidden_size / num_attention_heads = {self.hidden_size // self.num_attention_heads}, "
                             f"got {self.head_dim}: remove head_dim from config.json")


class OlmoeAttention(Olmo2Attention):
    """OLMo 2's q/k norm over the whole projection with llama's RMSNorm, and clip_qkv."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # transformers' OlmoeRMSNorm is llama's: in bfloat16 it rounds before the weight multiplies (OLMo 2's after)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv

    def project_qk(self, q, k):
        q, k = super().project_qk(q, k)
        if self.clip_qkv is None:
            return q, k
        return q.clamp(-self.clip_qkv, self.clip_qkv), k.clamp(-self.clip_qkv, self.clip_qkv)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        if self.clip_qkv is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                   cache_position)
        # llama's forward with v clamped too (project_qk clamps q and k after their norms)
        batch, seq, _ = hidden_states.shape
        q_proj, k_proj, v_proj, o_proj = self.q_proj, self.k_proj, self.v_proj, self.o_proj
        q = q_proj(hidden_states).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = k_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        v = v_proj(hidden_states).clamp(-self.clip_qkv, self.clip_qkv).view(batch, seq, -1, self.head_dim)
        return o_proj(self.attend(q, k, v, position_embeddings, attention_mask, past_key_values, cache_position))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.mlp = SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_experts,
                                  config.num_experts_per_tok, config.norm_topk_prob)


class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's forward (router logits, aux loss) over OLMoE's decoder layers."""

    config_class = OlmoeConfig
    decoder_layer_class = OlmoeDecoderLayer
    tp_plan_auto = None  # the llama plan splits q_proj / k_proj by heads, which q_norm / k_norm reduce over
