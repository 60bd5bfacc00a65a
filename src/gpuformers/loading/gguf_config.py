"""The config of a GGUF file: llama.cpp's {arch}.* and tokenizer.ggml.* metadata read back into the
config.json and generation_config.json dicts of the HF family that architecture is.

Besides the common fields, each family gets those only it has (experts, partial rotary, Gemma's scalars and
soft-caps), and the rope scaling comes back too (linear, yarn, Phi-3's longrope, and Llama 3's, recovered from the
rope_freqs tensor).

Offers: `GGUFConfigMixin` (GGUFCheckpoint's metadata reader and config builders), `SUPPORTED_ARCHITECTURES`, and
the family tables gguf.py reads (`MOE_ARCHITECTURES`, `NORM_PLUS_ONE_ARCHITECTURES`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# general.architecture (llama.cpp's name) -> (HF model_type, HF architecture): the families transformers' own
# GGUF loader reads (its GGUF_CONFIG_MAPPING) that gpuformers has models for. llama.cpp also writes Mistral and
# SmolLM files as "llama"; a llama file with experts (Mixtral) is refused, as transformers cannot load it either.
_FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe")
# llama.cpp stores Gemma's RMSNorm weights as 1 + w, the factor the norm multiplies by; HF keeps w.
NORM_PLUS_ONE_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp scales Gemma's queries by 1/sqrt(hidden / heads) in the 27B models (told apart by their layer count)
# and by 1/sqrt(head_dim) in the others: the query_pre_attn_scalar of their config.json files.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class GGUFConfigMixin:
    """The metadata side of GGUFCheckpoint (gguf.py), which holds the state these methods read: `_metadata` (the
    file's metadata), `_reader`, `architecture`, `path`, `_tensors` and `tensor_shape` / `_info`."""

    # ----- metadata -----

    def _meta(self, key: str, default: Any = None) -> Any:
        """The metadata value under `key` as a Python value (str, int, float, bool or list; loading/gguf_file.py)."""
        return self._metadata.get(key, default)

    def _build_config(self) -> dict:
        arch = self.architecture
        meta = lambda key, default=None: self._meta(f"{arch}.{key}", default)  # noqa: E731
        hidden = meta("embedding_length")
        heads = meta("attention.head_count")
        kv_heads = meta("attention.head_count_kv", heads)
        # key_length is written where head_dim is not hidden / heads (Qwen3, Mistral Nemo, Gemma); Phi-3's
        # rope.dimension_count is its rotary width, which is not head_dim when only part of each head turns
        rotary = meta("rope.dimension_count")
        head_dim = meta("attention.key_length") or (rotary if arch != "phi3" else None) or hidden // heads
        tokens = self._meta("tokenizer.ggml.tokens")
        vocab_size = meta("vocab_size") or (len(tokens) if tokens is not None else None)
        if vocab_size is None:
            vocab_size = self.tensor_shape("model.embed_tokens.weight")[0]
        config = {
            "architectures": [_FAMILIES[arch][1]],
            "model_type": _FAMILIES[arch][0],
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": meta("feed_forward_length"),
            "num_hidden_layers": meta("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": meta("context_length", 2048),
            "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": meta("rope.freq_base", 10000.0),
            # llama.cpp writes output.weight only when it differs from the embedding
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": self._meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._meta("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self._meta("tokenizer.ggml.padding_token_id"),
            "dtype": self._float_dtype_name(),
        }
        if arch == "qwen2moe":  # q/k/v biases under Qwen2-MoE's own name
            config["qkv_bias"] = "model.layers.0.self_attn.q_proj.bias" in self._tensors
        elif arch != "qwen2":  # Qwen2 always has q/k/v biases: its model_type says so
            config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self._tensors
        if arch == "llama":
            config["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in self._tensors
        rope_scaling = self._rope_scaling(head_dim, config["rope_theta"])
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        config |= self._family_fields(config, rotary)
        missing = [key for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                   if config[key] is None]
        if missing:
            raise ValueError(
                f"{self.path.name} lacks {arch}.* metadata for {', '.join(missing)}; is the file complete?"
            )
        return config

    def _family_fields(self, config: dict, rotary: int | None) -> dict:
        """The config.json fields only this architecture has, under the names its HF config reads."""
        arch = self.architecture
        meta = lambda key, default=None: self._meta(f"{arch}.{key}", default)  # noqa: E731
        if arch == "qwen3moe":
            expert_rows = self._info("model.layers.0.mlp.experts.0.gate_proj.weight").shape[1]
            return {
                "num_experts": meta("expert_count"),
                "num_experts_per_tok": meta("expert_used_count"),
                "moe_intermediate_size": meta("expert_feed_forward_length") or int(expert_rows),
                # llama.cpp's qwen3moe graph renormalises the top-k weights unless the file says otherwise
                "norm_topk_prob": bool(meta("expert_weights_norm", True)),
            }
        if arch == "qwen2moe":
            expert_rows = self._info("model.layers.0.mlp.experts.0.gate_proj.weight").shape[1]
            shared_rows = self.tensor_shape("model.layers.0.mlp.shared_expert.gate_proj.weight")[0]
            return {
                "num_experts": meta("expert_count"),
                "num_experts_per_tok": meta("expert_used_count"),
                "moe_intermediate_size": meta("expert_feed_forward_length") or int(expert_rows),
                "shared_expert_intermediate_size": meta("expert_shared_feed_forward_length") or shared_rows,
                # llama.cpp's qwen2moe graph uses the top-k softmax weights as they are
                "norm_topk_prob": bool(meta("expert_weights_norm", False)),
            }
        if arch == "phi3":
            fields = {"sliding_window": meta("attention.sliding_window")}
            if rotary and rotary != config["head_dim"]:  # Phi-4-mini turns 3/4 of each head
                fields["partial_rotary_factor"] = rotary / config["head_dim"]
            original = meta("rope.scaling.original_context_length")
            if original:  # longrope's pretraining length, which Phi3Config reads at the top level
                fields["original_max_position_embeddings"] = original
            return fields
        if arch in NORM_PLUS_ONE_ARCHITECTURES:
            hidden, heads = config["hidden_size"], config["num_attention_heads"]
            big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
            fields = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                      "query_pre_attn_scalar": hidden // heads if big else config["head_dim"]}
            if meta("attention.sliding_window"):
                fields["sliding_window"] = meta("attention.sliding_window")
            if arch == "gemma2":  # Gemma 3 has no soft-caps
                fields["attn_logit_softcapping"] = meta("attn_logit_softcapping", 50.0)
                fields["final_logit_softcapping"] = meta("final_logit_softcapping", 30.0)
            return fields
        return {}

    def _float_dtype_name(self) -> str:
        """The dtype the weights were written in: float16 / bfloat16 files keep it, quantized ones use float32."""
        kinds = {info.tensor_type.name for info, *_ in self._tensors.values() if len(info.shape) > 1}
        for name, dtype in (("BF16", "bfloat16"), ("F16", "float16")):
            if kinds == {name}:
                return dtype
        return "float32"

    def _rope_scaling(self, head_dim: int, rope_theta: float) -> dict | None:
        """HF rope_scaling from {arch}.rope.scaling.* keys, or from the rope_freqs tensor of a Llama 3.x file."""
        prefix = f"{self.architecture}.rope.scaling"
        kind = self._meta(f"{prefix}.type")
        factor = self._meta(f"{prefix}.factor")
        original = self._meta(f"{prefix}.original_context_length")
        if kind in ("linear", "yarn") and factor:
            scaling = {"rope_type": kind, "factor": factor}
            if kind == "yarn" and original:
                scaling["original_max_position_embeddings"] = original
            return scaling
        if kind not in (None, "none"):
            raise ValueError(f"{prefix}.type {kind!r} in {self.path.name} is not one of: none, linear, yarn")
        names = {info.name for info in self._reader.tensors}
        if "rope_factors_long.weight" in names:  # Phi-3 128k: longrope's per-frequency factors
            return {"rope_type": "longrope", "long_factor": self._small_tensor("rope_factors_long.weight"),
                    "short_factor": self._small_tensor("rope_factors_short.weight"),
                    "original_max_position_embeddings": original or 4096}
        if "rope_freqs.weight" not in names:
            return None
        return self._llama3_rope_scaling(head_dim, rope_theta, original)

    def _llama3_rope_scaling(self, head_dim: int, rope_theta: float, original: int | None) -> dict:
        """Recover Llama 3's rope parameters from the per-frequency divisors llama.cpp stores in rope_freqs.

        llama.cpp bakes `factor`, `low_freq_factor`, `high_freq_factor` and the original context into one
        (head_dim/2,) tensor. We take factor = its largest entry, rebuild the tensor from Llama 3's usual
        (1, 4, 8192) and accept them only if every entry matches.
        """
        stored = torch.tensor(self._small_tensor("rope_freqs.weight"))  # (head_dim/2,)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        wavelen = 2 * math.pi / inv_freq
        factor = float(stored.max())
        for low, high, context in ((1.0, 4.0, original or 8192),):
            smooth = ((context / wavelen - low) / (high - low)).clamp(0, 1)
            divisor = 1 / ((1 - smooth) / factor + smooth)  # 1 at high frequencies, factor at low ones
            if stored.numel() == divisor.numel() and torch.allclose(stored.double(), divisor, rtol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": int(context)}
        raise ValueError(
            f"{self.path.name} has a rope_freqs tensor that does not match Llama 3 rope scaling "
            f"(factor {factor}, low/high frequency factors 1/4, original context {original or 8192}); "
            "this rope variant is not supported"
        )

    def _small_tensor(self, gguf_name: str) -> list[float]:
        """A float32 tensor that is not a parameter (rope_freqs, rope_factors_*), as a flat list."""
        info = next(info for info in self._reader.tensors if info.name == gguf_name)
        return np.array(info.data, dtype=np.float32).reshape(-1).tolist()

    def _build_generation_config(self) -> dict:
        eos = self._meta("tokenizer.ggml.eos_token_id")
        # end-of-turn / end-of-message tokens also stop chat models (Llama 3 <|eot_id|>, <|eom_id|>)
        stops = [eos] + [self._meta(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
        stops = list(dict.fromkeys(token for token in stops if token is not None))
        config = {
            "bos_token_id": self._meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
            "pad_token_id": self._meta("tokenizer.ggml.padding_token_id"),
        }
        return {key: value for key, value in config.items() if value is not None}
