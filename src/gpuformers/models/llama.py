"""The llama-family decoder: Llama, Mistral and Qwen2 are this one model with different config flags.

    input_ids -> embed_tokens -> [DecoderLayer x N] -> norm -> lm_head -> logits
    DecoderLayer: h = h + attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h))

Differences between families live in ModelConfig: q/k/v biases (Qwen2), sliding-window layers (Mistral, Qwen2),
q/k RMSNorm (Qwen3, a subclass in qwen3.py). Module and parameter names are the Hugging Face checkpoint keys.

Offers: LlamaAttention, LlamaDecoderLayer, LlamaModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.
"""

from __future__ import annotations

import torch
from torch import nn

from gpuformers.generation.cache import Cache
from gpuformers.layers.attention import AttentionInterface, build_attention_mask, build_attention_mask_at
from gpuformers.kernels.mapping import active_kernel_functions
from gpuformers.layers.loss import causal_lm_loss, linear_causal_lm_loss, logits_needed
from gpuformers.layers.mlp import GatedMLP
from gpuformers.layers.moe import host_syncing_modules
from gpuformers.layers.norm import RMSNorm, add_rms_norm
from gpuformers.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb
from gpuformers.models.config import ModelConfig
from gpuformers.models.modeling import PreTrainedModel
from gpuformers.outputs import CausalLMOutput


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.sliding_window = config.layer_sliding_window(layer_idx)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_bias)
        self.attention_fn = AttentionInterface.get("sdpa")

    def project_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for families that transform q and k per head before rotary (Qwen3's q/k norm)."""
        return q, k

    def position_qk(self, q: torch.Tensor, k: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """q (batch, seq, heads, head_dim), k (batch, seq, kv_heads, head_dim) -> both through project_qk and
        rotary, as (batch, heads, seq, head_dim)."""
        q, k = self.project_qk(q, k)
        cos, sin = position_embeddings
        return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_embeddings, attention_mask,
               past_key_values: Cache | None, cache_position: torch.Tensor | None = None) -> torch.Tensor:
        """What follows the projections, for every family's attention: q (batch, seq, heads, head_dim), k and v
        (batch, seq, kv_heads, head_dim) -> position_qk, the KV cache, the attention backend -> (batch, seq,
        heads * head_dim), the output projection's input."""
        batch, seq = q.shape[:2]
        q, k = self.position_qk(q, k, position_embeddings)
        v = v.transpose(1, 2)  # (batch, kv_heads, seq, head_dim)
        if past_key_values is not None:
            k, v = past_key_values.update(self.layer_idx, k, v, cache_position)
        out, _ = self.attention_fn(self, q, k, v, attention_mask, scaling=self.scaling,
                                   dropout=self.attention_dropout, sliding_window=self.sliding_window)
        return out.reshape(batch, seq, -1)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values: Cache | None,
                cache_position: torch.Tensor | None = None):
        batch, seq, _ = hidden_states.shape
        q_proj, k_proj, v_proj, o_proj = self.q_proj, self.k_proj, self.v_proj, self.o_proj
        q = q_proj(hidden_states).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = k_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        v = v_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        return o_proj(self.attend(q, k, v, position_embeddings, attention_mask, past_key_values, cache_position))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position=None):
        input_norm, attn, mlp = self.input_layernorm, self.self_attn, self.mlp
        attn_out = attn(input_norm(hidden_states), position_embeddings, attention_mask, past_key_values, cache_position)
        # residual add + post-attention norm: one fused kernel with use_kernels=True
        normed, hidden_states = add_rms_norm(attn_out, hidden_states, self.post_attention_layernorm)
        return hidden_states + mlp(normed)


class LlamaModel(nn.Module):
    """The decoder stack without the LM head: input_ids -> final hidden states (batch, seq, hidden)."""

    def __init__(self, config: ModelConfig, layer_class=LlamaDecoderLayer):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # The distinct sliding windows of the layers (None = full attention): one mask each per forward.
        self._windows = sorted({config.layer_sliding_window(i) for i in range(config.num_hidden_layers)},
                               key=lambda w: (w is not None, w or 0))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, output_hidden_states=False, cache_position=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        batch, seq, _ = inputs_embeds.shape
        if cache_position is not None:
            # The compiled decode path: positions arrive as a tensor, nothing here reads a length from the cache.
            return self._forward_at(inputs_embeds, attention_mask, position_ids, past_key_values, cache_position,
                                    output_hidden_states)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        kv_len = past_key_values.kv_length(seq) if past_key_values is not None else seq
        if position_ids is None:
            # Like transformers' forward: positions are cache positions; generate() passes padding-aware ones.
            position_ids = torch.arange(past_len, past_len + seq, device=inputs_embeds.device)[None].expand(batch, -1)
        if attention_mask is not None and attention_mask.shape[-1] < past_len + seq:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} positions but the cache holds {past_len} and "
                f"{seq} new tokens were given: pass a mask over past and new tokens ({past_len + seq})"
            )
        device = inputs_embeds.device
        masks = {w: build_attention_mask(attention_mask, seq, kv_len, past_len, w, device) for w in self._windows}
        return self._run_layers(inputs_embeds, position_ids, masks, past_key_values, None, output_hidden_states)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids -> the first layer's input (batch, seq, hidden); a family that scales its embeddings
        overrides this (every caller of the stack, the engine's included, goes through it)."""
        return self.embed_tokens(input_ids)

    def _forward_at(self, inputs_embeds, attention_mask, position_ids, past_key_values, cache_position,
                    output_hidden_states):
        """Tokens at cache positions `cache_position` (seq,): the mask is built from that tensor."""
        batch, seq, _ = inputs_embeds.shape
        if position_ids is None:
            position_ids = cache_position[None].expand(batch, -1)
        kv_len = past_key_values.kv_length(seq) if past_key_values is not None else seq
        masks = {w: build_attention_mask_at(attention_mask, cache_position, kv_len, w) for w in self._windows}
        return self._run_layers(inputs_embeds, position_ids, masks, past_key_values, cache_position,
                                output_hidden_states)

    def _run_layers(self, inputs_embeds, position_ids, masks, past_key_values, cache_position, output_hidden_states):
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        all_hidden = [hidden_states] if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, position_embeddings, masks[layer.self_attn.sliding_window], past_key_values,
                cache_position,
            )
            if output_hidden_states:
                all_hidden.append(hidden_states)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden[-1] = hidden_states
        return hidden_states, all_hidden


class LlamaForCausalLM(PreTrainedModel):
    decoder_model_class = LlamaModel  # the stack; a family that changes it (embedding scale) names its own
    decoder_layer_class = LlamaDecoderLayer

    @property
    def supports_compiled_decode(self) -> bool:
        # dynamic and longrope pick their frequencies from the longest position: a host sync per step.
        if self.config.rope_type in ("dynamic", "longrope"):
            return False
        # A layer whose forward reads values on the host (the MoE blocks' torch forward: which experts got tokens,
        # `syncs_host`) breaks the compiled graph at every layer and changes its shapes with the routing: recompiles
        # and CUDA graph re-recordings, slower than eager. A kernel that replaced that forward (use_kernels) syncs
        # nothing.
        return not host_syncing_modules(self)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = self.decoder_model_class(config, self.decoder_layer_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        if not self.config.tie_word_embeddings:
            return {}
        return {"lm_head.weight": "model.embed_tokens.weight"}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final hidden states (..., hidden) -> logits (..., vocab): the LM head, and in a family that transforms
        its logits (scaling, soft-capping) that too; the engine computes its logits through this."""
        return self.lm_head(hidden_states)

    @property
    def logits_are_head_output(self) -> bool:
        """Whether compute_logits is the LM head alone: only then may training fuse the head with the loss (the
        Triton kernel, or the chunked torch loss), which never makes the logits."""
        return type(self).compute_logits is LlamaForCausalLM.compute_logits

    def _forward_cache(self, use_cache: bool | None, past_key_values: Cache | None) -> Cache | None:
        """The cache a forward fills and returns (this class's and the task heads'): None without use_cache
        (default: config.use_cache, outside training), else past_key_values or a new one (make_cache)."""
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if not use_cache:
            return None
        return self.make_cache() if past_key_values is None else past_key_values

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        output_hidden_states: bool = False,
        cache_position: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        """input_ids (batch, seq) -> CausalLMOutput(loss, logits (batch, seq or logits_to_keep, vocab), cache).

        `logits_to_keep=k` computes logits for the last k positions only (generation needs one).
        `cache_position` (seq,): the cache slots of the new tokens, as a tensor. Given, the forward never reads a
        length from the cache (no host sync, no value-dependent shape), which is what a compiled decode step over a
        StaticCache needs; the caller then keeps the cache's count of written tokens (StaticCache.mark_written).
        """
        if kwargs:
            raise TypeError(f"forward() got unexpected arguments: {', '.join(sorted(kwargs))}")
        cache = self._forward_cache(use_cache, past_key_values)
        hidden_states, all_hidden = self.model(
            input_ids, attention_mask, position_ids, cache, inputs_embeds, output_hidden_states, cache_position,
        )
        plain_head = type(self.lm_head) is nn.Linear and self.lm_head.bias is None  # not quantized, not a LoRA
        fusable = labels is not None and self.training and self.logits_are_head_output
        if fusable and (_fused_loss_active() or (plain_head and not logits_needed())):
            # The LM head and the loss fused, the (tokens, vocab) logits never exist: the Triton kernel with
            # use_kernels=True in training, else the chunked torch version when the caller reads no logits (the
            # Trainer's training step, inside layers/loss.py's logits_not_needed()).
            loss = linear_causal_lm_loss(hidden_states, self.lm_head.weight, labels, num_items_in_batch)
            return CausalLMOutput(loss=loss, logits=None, past_key_values=cache,
                                  hidden_states=tuple(all_hidden) if output_hidden_states else None)
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.compute_logits(hidden_states)
        loss = causal_lm_loss(logits, labels, num_items_in_batch) if labels is not None else None
        return CausalLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=cache,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
        )


def _fused_loss_active() -> bool:
    """True inside the forward of a model kernelized for training with the fused LM-head loss."""
    return "LinearForCausalLMLoss" in active_kernel_functions()


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the llama decoder with a sliding window on every layer (config.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the llama decoder with q/k/v biases and optional sliding-window layers (config flags)."""
