"""HF `model_type` / `architectures` strings -> our model and config classes, imported only when asked for.

One row per model_type: the class of its architecture (also what a config.json without `architectures` means) and
the class that reads its config.json. The llama-family core reads into ModelConfig itself; a family with its own
config class keeps it beside its model, so reading such a config imports that model file, and nothing else does.

Offers: model_class_for, config_class_for, default_architecture, MODEL_TYPES, SUPPORTED_ARCHITECTURES.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py imports this table: the names stay strings until a class is asked for
    from gpuformers.models.config import ModelConfig

_CORE = "gpuformers.models.config:ModelConfig"

# model_type -> ("module:model class", "module:config class"); the model class's name is the HF architecture.
MODEL_TYPES = {
    "llama": ("gpuformers.models.llama:LlamaForCausalLM", _CORE),
    "mistral": ("gpuformers.models.llama:MistralForCausalLM", _CORE),
    "qwen2": ("gpuformers.models.llama:Qwen2ForCausalLM", _CORE),
    "qwen3": ("gpuformers.models.qwen3:Qwen3ForCausalLM", _CORE),
    "qwen3_moe": ("gpuformers.models.qwen3_moe:Qwen3MoeForCausalLM", "gpuformers.models.qwen3_moe:Qwen3MoeConfig"),
    "qwen2_moe": ("gpuformers.models.qwen2_moe:Qwen2MoeForCausalLM", "gpuformers.models.qwen2_moe:Qwen2MoeConfig"),
    "smollm3": ("gpuformers.models.smollm3:SmolLM3ForCausalLM", "gpuformers.models.smollm3:SmolLM3Config"),
    "granite": ("gpuformers.models.granite:GraniteForCausalLM", "gpuformers.models.granite:GraniteConfig"),
    "olmo2": ("gpuformers.models.olmo2:Olmo2ForCausalLM", "gpuformers.models.olmo2:Olmo2Config"),
    "mixtral": ("gpuformers.models.mixtral:MixtralForCausalLM", "gpuformers.models.mixtral:MixtralConfig"),
    "phi3": ("gpuformers.models.phi3:Phi3ForCausalLM", "gpuformers.models.phi3:Phi3Config"),
    "gemma": ("gpuformers.models.gemma:GemmaForCausalLM", "gpuformers.models.gemma:GemmaConfig"),
    "gemma2": ("gpuformers.models.gemma:Gemma2ForCausalLM", "gpuformers.models.gemma:Gemma2Config"),
    "gemma3_text": ("gpuformers.models.gemma:Gemma3ForCausalLM", "gpuformers.models.gemma:Gemma3TextConfig"),
    "gpt_oss": ("gpuformers.models.gpt_oss:GptOssForCausalLM", "gpuformers.models.gpt_oss:GptOssConfig"),
    "glm": ("gpuformers.models.glm4:GlmForCausalLM", "gpuformers.models.glm4:Glm4Config"),
    "glm4": ("gpuformers.models.glm4:Glm4ForCausalLM", "gpuformers.models.glm4:Glm4Config"),
    "olmoe": ("gpuformers.models.olmoe:OlmoeForCausalLM", "gpuformers.models.olmoe:OlmoeConfig"),
    "ministral": ("gpuformers.models.ministral:MinistralForCausalLM", "gpuformers.models.ministral:MinistralConfig"),
    "ministral3": ("gpuformers.models.ministral:Ministral3ForCausalLM", "gpuformers.models.ministral:Ministral3Config"),
    "exaone4": ("gpuformers.models.exaone4:Exaone4ForCausalLM", "gpuformers.models.exaone4:Exaone4Config"),
    "ernie4_5": ("gpuformers.models.ernie4_5:Ernie4_5ForCausalLM", "gpuformers.models.ernie4_5:Ernie4_5Config"),
    "seed_oss": ("gpuformers.models.seed_oss:SeedOssForCausalLM", "gpuformers.models.seed_oss:SeedOssConfig"),
    "gpt_neox": ("gpuformers.models.gpt_neox:GPTNeoXForCausalLM", "gpuformers.models.gpt_neox:GPTNeoXConfig"),
    "starcoder2": ("gpuformers.models.starcoder2:Starcoder2ForCausalLM",
                   "gpuformers.models.starcoder2:Starcoder2Config"),
    "gpt2": ("gpuformers.models.gpt2:GPT2LMHeadModel", "gpuformers.models.gpt2:GPT2Config"),
    "mamba2": ("gpuformers.models.mamba2:Mamba2ForCausalLM", "gpuformers.models.mamba2:Mamba2Config"),
    "nemotron_h": ("gpuformers.models.nemotron_h:NemotronHForCausalLM",
                   "gpuformers.models.nemotron_h:NemotronHConfig"),
    "granitemoehybrid": ("gpuformers.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
                         "gpuformers.models.granitemoehybrid:GraniteMoeHybridConfig"),
    "falcon_h1": ("gpuformers.models.falcon_h1:FalconH1ForCausalLM", "gpuformers.models.falcon_h1:FalconH1Config"),
}

# architecture name -> "module:Class", and the model_type each one belongs to
SUPPORTED_ARCHITECTURES = {model.split(":")[1]: model for model, _ in MODEL_TYPES.values()}
_MODEL_TYPE = {model.split(":")[1]: model_type for model_type, (model, _) in MODEL_TYPES.items()}


def _import(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def default_architecture(model_type: str) -> str:
    """The architecture a config.json of this model_type means when it has no `architectures`."""
    return MODEL_TYPES[model_type][0].split(":")[1]


def config_class_for(model_type: str) -> type[ModelConfig]:
    """The class that reads a config.json of this (supported) model_type."""
    return _import(MODEL_TYPES[model_type][1])


def model_class_for(config: ModelConfig):
    architecture = config.architecture
    target = SUPPORTED_ARCHITECTURES.get(architecture)
    if target is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    expected = _MODEL_TYPE[architecture]
    if config.model_type != expected:
        raise ValueError(
            f"config.json says model_type {config.model_type!r} but architecture {architecture!r}, which is a "
            f"{expected!r} model; fix one of them"
        )
    return _import(target)
