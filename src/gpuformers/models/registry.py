"""HF `architectures` / `model_type` strings -> our model classes, imported only when asked for.

Offers: model_class_for, SUPPORTED_ARCHITECTURES.
"""

from __future__ import annotations

import importlib

from gpuformers.models.config import ModelConfig

# architecture name -> "module:Class"
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "gpuformers.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "gpuformers.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "gpuformers.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "gpuformers.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "gpuformers.models.qwen3_moe:Qwen3MoeForCausalLM",
    "GemmaForCausalLM": "gpuformers.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "gpuformers.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gpuformers.models.gemma:Gemma3ForCausalLM",
    "MixtralForCausalLM": "gpuformers.models.mixtral:MixtralForCausalLM",
    "SmolLM3ForCausalLM": "gpuformers.models.smollm3:SmolLM3ForCausalLM",
    "GraniteForCausalLM": "gpuformers.models.granite:GraniteForCausalLM",
    "Olmo2ForCausalLM": "gpuformers.models.olmo2:Olmo2ForCausalLM",
    "Phi3ForCausalLM": "gpuformers.models.phi3:Phi3ForCausalLM",
}

_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
}


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
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
