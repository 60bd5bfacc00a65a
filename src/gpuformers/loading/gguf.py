"""GGUF checkpoints: llama.cpp's single-file format, read as a Hugging Face checkpoint of one of the families that
transformers itself loads from GGUF (llama, qwen2, qwen3, qwen3_moe, qwen2_moe, phi3, gemma2, gemma3_text).

A GGUF file holds the model config, the tokenizer and the (often quantized) weights, all under
llama.cpp's names. This module turns each of those into what the rest of gpuformers reads from an HF
folder, so `from_pretrained(path, gguf_file=...)` only has to glue them in:

    ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config                      # a config.json-style dict (model_type "llama", "qwen3_moe", "gemma2", ...)
    ckpt.generation_config           # a generation_config.json-style dict
    for name in ckpt.tensor_names():  # HF names: model.layers.0.self_attn.q_proj.weight, ...
        ckpt.load_tensor(name, torch.bfloat16, "cuda")
    tokenizer, tokenizer_config = ckpt.tokenizer_parts()

Offers: `read_gguf`, `GGUFCheckpoint`, `SUPPORTED_ARCHITECTURES`, `supported_quant_types()`.

Weights are dequantized with the `gguf` package one tensor, and within a tensor one slab of rows,
at a time, straight into the requested dtype and device: a model is never held in float32 whole.
Where llama.cpp's layout differs from HF's, the tensor is turned back as it is read:

    llama      q/k rows of each head interleaved          -> the two rotary halves apart again
    qwen*moe   blk.N.ffn_gate_exps (experts, ff, hidden)  -> one mlp.experts.E.gate_proj per expert (rows E*ff..)
    qwen2moe   blk.N.ffn_gate_inp_shexp (hidden,)         -> mlp.shared_expert_gate.weight (1, hidden)
    gemma2/3   every RMSNorm weight stored as 1 + w       -> w (Gemma's norm multiplies by 1 + weight)
    phi3       attn_qkv, ffn_up (gate and up fused)       -> self_attn.qkv_proj, mlp.gate_up_proj as they are
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuformers.loading.gguf_tokenizer import tokenizer_parts

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
_MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe")
# llama.cpp's converter reorders q/k rows for llama only; it writes the others in HF order.
_ROTARY_PERMUTED = ("llama",)
# llama.cpp stores Gemma's RMSNorm weights as 1 + w, the factor the norm multiplies by; HF keeps w.
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp scales Gemma's queries by 1/sqrt(hidden / heads) in the 27B models (told apart by their layer count)
# and by 1/sqrt(head_dim) in the others: the query_pre_attn_scalar of their config.json files.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# Elements dequantized per slab (16 MiB of float32): bounds the extra memory a big tensor needs.
_SLAB_ELEMENTS = 1 << 22

# llama.cpp block name -> HF module name inside model.layers.{i}
_LAYER_NAMES = {
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
# What each architecture adds to (or renames in) _LAYER_NAMES.
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # per-head RMSNorm on q, k
_GEMMA_NORMS = {  # Gemma 2 / 3 norm both sides of attention and MLP; llama.cpp's ffn_norm is the pre-MLP one
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EXTRA_LAYER_NAMES = {
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
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors with no HF parameter: rope_freqs (Llama 3) and rope_factors_long/short (Phi-3 longrope) become
# config.rope_scaling, attn_rot_embd is an old cache.
_NOT_PARAMETERS = re.compile(r"rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd\.weight")

def read_gguf(path: str | os.PathLike) -> "GGUFCheckpoint":
    """Open a GGUF file and check that gpuformers can load it (architecture, quant types, tensors)."""
    return GGUFCheckpoint(path)


@functools.cache
def _can_dequantize(qtype: int) -> bool:
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

    return [t.name for t in GGMLQuantizationType if _can_dequantize(int(t))]


class GGUFCheckpoint:
    """One GGUF file, memory-mapped: HF-style config, tensors under HF names, and the tokenizer."""

    def __init__(self, path: str | os.PathLike):
        try:
            from gguf import GGUFReader
        except ImportError as error:
            raise ImportError(
                "Loading a GGUF file needs the `gguf` package: pip install 'gpuformers[gguf]' (or pip install gguf)"
            ) from error
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist (or is not a file)")
        with open(self.path, "rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise ValueError(
                f"{str(self.path)!r} is not a GGUF file: it starts with {magic!r} instead of b'GGUF'. "
                "Pass a llama.cpp .gguf file as gguf_file, or load .safetensors checkpoints without gguf_file."
            )
        self._reader = GGUFReader(self.path, "r")
        self._fields = self._reader.fields
        self.architecture = arch = self._meta("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} ({self.path.name}) is not supported; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if (self._meta(f"{arch}.expert_count") or 0) > 0 and arch not in _MOE_ARCHITECTURES:
            raise ValueError(
                f"{self.path.name} is a mixture-of-experts {arch} ({self._meta(f'{arch}.expert_count')} experts), "
                f"as llama.cpp writes Mixtral; transformers' GGUF loader does not load it and neither does gpuformers "
                f"(mixture-of-experts architecture: {', '.join(_MOE_ARCHITECTURES)}; all architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._tensors = self._map_tensor_names()
        self._check_quant_types()
        self.config = self._build_config()
        self.generation_config = self._build_generation_config()

    # ----- metadata -----

    def _meta(self, key: str, default: Any = None) -> Any:
        """The metadata value under `key` as a Python value (str, int, float, bool or list)."""
        from gguf import GGUFValueType

        field = self._fields.get(key)
        if field is None:
            return default
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            item = field.types[1] if len(field.types) > 1 else None
            if not field.data:
                return []
            if item == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            if item == GGUFValueType.ARRAY:
                return default  # nested arrays: no llama key uses them
            return np.concatenate([field.parts[i] for i in field.data]).tolist()
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        value = field.parts[field.data[0]][0]
        if kind == GGUFValueType.FLOAT32:
            # the shortest decimal that rounds to this float32: 1e-05, not 9.999999747378752e-06
            return float(str(value))
        if kind == GGUFValueType.BOOL:
            return bool(value)
        return value.item()

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
        tokens = self._fields.get("tokenizer.ggml.tokens")
        vocab_size = meta("vocab_size") or (len(tokens.data) if tokens is not None else None)
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
        if arch in _NORM_PLUS_ONE:
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

    # ----- tensors -----

    def _map_tensor_names(self) -> dict:
        """HF name -> (ReaderTensor, llama.cpp name, expert index or None), refusing tensors this loader does not
        understand. A stacked expert tensor gives one HF name per expert, all pointing at the same ReaderTensor."""
        tensors, unknown = {}, []
        layer_names = _LAYER_NAMES | _EXTRA_LAYER_NAMES.get(self.architecture, {})
        for info in self._reader.tensors:
            experts = _EXPERT_NAMES if self.architecture in _MOE_ARCHITECTURES else {}
            match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", info.name)
            if match and match.group(2) in experts:
                for expert in range(int(info.shape[-1])):  # ggml's slowest dimension is the expert
                    module = f"mlp.experts.{expert}.{experts[match.group(2)]}"
                    tensors[f"model.layers.{match.group(1)}.{module}.weight"] = (info, info.name, expert)
                continue
            hf_name = _hf_name(info.name, layer_names)
            if hf_name is not None:
                tensors[hf_name] = (info, info.name, None)
            elif not _NOT_PARAMETERS.fullmatch(info.name):
                unknown.append(info.name)
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise ValueError(
                f"{self.path.name} holds tensors a {self.architecture} model has no place for: {shown}. "
                f"Only llama.cpp's {self.architecture} layout is supported."
            )
        return tensors

    def _check_quant_types(self) -> None:
        for info, gguf_name, _ in self._tensors.values():
            if not _can_dequantize(int(info.tensor_type)):
                raise ValueError(
                    f"tensor {gguf_name} in {self.path.name} is stored as {info.tensor_type.name}, which the installed "
                    f"gguf package cannot dequantize; supported types: {', '.join(supported_quant_types())}. "
                    "Upgrading gguf may add it."
                )

    def tensor_names(self) -> list[str]:
        """HF parameter names in file order; lm_head.weight is absent when tied to the embedding."""
        return list(self._tensors)

    def _entry(self, hf_name: str) -> tuple:
        """(ReaderTensor, llama.cpp name, expert index or None) of an HF tensor name."""
        if hf_name not in self._tensors:
            raise KeyError(f"{hf_name!r} is not in {self.path.name}; its tensors are: {', '.join(self._tensors)}")
        return self._tensors[hf_name]

    def _info(self, hf_name: str):
        return self._entry(hf_name)[0]

    def tensor_shape(self, hf_name: str) -> tuple[int, ...]:
        """The HF (torch-order) shape of a tensor, read from the header without touching its data."""
        # ggml lists dimensions fastest-moving first; torch the other way round
        shape = tuple(int(d) for d in reversed(self._info(hf_name).shape.tolist()))
        if hf_name.endswith("mlp.shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp's {hidden}
            shape = (1, *shape)  # HF's Linear(hidden, 1)
        return shape if self._entry(hf_name)[2] is None else shape[1:]  # one expert of a stacked tensor

    def quant_type(self, hf_name: str) -> str:
        """The ggml type the tensor is stored as: F32, F16, BF16, Q8_0, Q4_K, ..."""
        return self._info(hf_name).tensor_type.name

    def load_tensor(self, hf_name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """One tensor under its HF name, dequantized slab by slab into `dtype` on `device`."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info, gguf_name, expert = self._entry(hf_name)
        shape = self.tensor_shape(hf_name)
        qtype = info.tensor_type
        # (rows, row_bytes) for block types, (rows, cols) for float types; one row = the fastest dimension
        data = np.asarray(info.data)
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 0 else data.reshape(1, 1)
        if expert is not None:  # (experts * expert_rows, ...): this expert's rows only
            expert_rows = rows.shape[0] // int(info.shape[-1])
            rows = rows[expert * expert_rows : (expert + 1) * expert_rows]
        cols = shape[-1] if shape else 1
        plus_one = self.architecture in _NORM_PLUS_ONE and gguf_name.endswith("norm.weight")
        final_dtype, dtype = dtype, (torch.float32 if plus_one else dtype)  # subtract before rounding
        out = torch.empty((rows.shape[0], cols), dtype=dtype, device=device)
        step = max(1, _SLAB_ELEMENTS // cols)
        for start in range(0, rows.shape[0], step):
            chunk = np.array(rows[start : start + step])  # copy: the mmap is read-only
            if qtype == GGMLQuantizationType.F16:
                values = torch.from_numpy(chunk.view(np.float16))
            elif qtype == GGMLQuantizationType.BF16:
                values = torch.from_numpy(chunk.view(np.int16)).view(torch.bfloat16)
            else:
                values = torch.from_numpy(np.ascontiguousarray(dequantize(chunk, qtype), dtype=np.float32))
            out[start : start + step] = values.reshape(-1, cols).to(dtype)
        out = out.reshape(shape)
        if plus_one:
            return (out - 1.0).to(final_dtype)
        if self.architecture not in _ROTARY_PERMUTED:
            return out
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            out = _unpermute_rotary_rows(out, self.config["num_attention_heads"])
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            out = _unpermute_rotary_rows(out, self.config["num_key_value_heads"])
        return out

    def tokenizer_parts(self):
        """`(tokenizers.Tokenizer, tokenizer_config dict)` rebuilt from the tokenizer.* metadata
        (loading/gguf_tokenizer.py says how)."""
        return tokenizer_parts(self._meta, self.path.name, self.config["max_position_embeddings"])


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
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


def _unpermute_rotary_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves, HF keeps them apart.

    A head's rows in HF order are [x0 .. x(h-1) | y0 .. y(h-1)] (h = head_dim/2, rotated as pairs (xi, yi));
    llama.cpp stores them as [x0 y0 x1 y1 ...]. Rows are whole, so this works after dequantizing.
    """
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    # (heads, half, 2, ...) in file order -> (heads, 2, half, ...) in HF order
    return tensor.reshape(num_heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
