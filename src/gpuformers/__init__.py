"""gpuformers: run, serve and train Hugging Face language models on NVIDIA GPUs with the transformers API.

The public names are imported lazily, so `import gpuformers` stays fast and `gpuformers env` works even
where torch is broken.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "AutoConfig": "gpuformers.models.auto",
    "AutoModelForCausalLM": "gpuformers.models.auto",
    "AutoModel": "gpuformers.models.auto",
    "AutoModelForSequenceClassification": "gpuformers.models.auto",
    "AutoTokenizer": "gpuformers.models.auto",
    "ModelConfig": "gpuformers.models.config",
    "PreTrainedTokenizerFast": "gpuformers.tokenizer",
    "LlamaForCausalLM": "gpuformers.models.llama",
    "MistralForCausalLM": "gpuformers.models.llama",
    "Qwen2ForCausalLM": "gpuformers.models.llama",
    "Qwen3ForCausalLM": "gpuformers.models.qwen3",
    "CausalLMOutput": "gpuformers.outputs",
    "MoeCausalLMOutput": "gpuformers.outputs",
    "Qwen3MoeForCausalLM": "gpuformers.models.qwen3_moe",
    "Qwen2MoeForCausalLM": "gpuformers.models.qwen2_moe",
    "MixtralForCausalLM": "gpuformers.models.mixtral",
    "Phi3ForCausalLM": "gpuformers.models.phi3",
    "GemmaForCausalLM": "gpuformers.models.gemma",
    "Gemma2ForCausalLM": "gpuformers.models.gemma",
    "Gemma3ForCausalLM": "gpuformers.models.gemma",
    "GptOssForCausalLM": "gpuformers.models.gpt_oss",
    "GraniteForCausalLM": "gpuformers.models.granite",
    "Olmo2ForCausalLM": "gpuformers.models.olmo2",
    "OlmoeForCausalLM": "gpuformers.models.olmoe",
    "GlmForCausalLM": "gpuformers.models.glm4",
    "Glm4ForCausalLM": "gpuformers.models.glm4",
    "SmolLM3ForCausalLM": "gpuformers.models.smollm3",
    "Exaone4ForCausalLM": "gpuformers.models.exaone4",
    "MinistralForCausalLM": "gpuformers.models.ministral",
    "Ministral3ForCausalLM": "gpuformers.models.ministral",
    "Ernie4_5ForCausalLM": "gpuformers.models.ernie4_5",
    "SeedOssForCausalLM": "gpuformers.models.seed_oss",
    "Starcoder2ForCausalLM": "gpuformers.models.starcoder2",
    "GPTNeoXForCausalLM": "gpuformers.models.gpt_neox",
    "GPT2LMHeadModel": "gpuformers.models.gpt2",
    "DynamicCache": "gpuformers.generation.cache",
    "StaticCache": "gpuformers.generation.cache",
    "GenerationConfig": "gpuformers.generation.config",
    "TextStreamer": "gpuformers.generation.streamers",
    "TextIteratorStreamer": "gpuformers.generation.streamers",
    "pipeline": "gpuformers.pipeline",
    "AttentionInterface": "gpuformers.layers.attention",
    "KernelConfig": "gpuformers.kernels.mapping",
    "Mode": "gpuformers.kernels.mapping",
    "kernelize": "gpuformers.kernels.mapping",
    "TrainingArguments": "gpuformers.training.arguments",
    "Trainer": "gpuformers.training.trainer",
    "EarlyStoppingCallback": "gpuformers.training.callbacks",
    "DataCollatorForCausalLM": "gpuformers.training.data",
    "DataCollatorForLanguageModeling": "gpuformers.training.data",
    "LoraConfig": "gpuformers.lora",
    "get_peft_model": "gpuformers.lora",
    "PeftModel": "gpuformers.lora",
    "prepare_model_for_kbit_training": "gpuformers.lora",
    "BitsAndBytesConfig": "gpuformers.quantization.config",
    "WeightOnlyConfig": "gpuformers.quantization.config",
    "FineGrainedFP8Config": "gpuformers.quantization.config",
    "GPTQConfig": "gpuformers.quantization.gptq_awq",
    "AwqConfig": "gpuformers.quantization.gptq_awq",
    "CompressedTensorsConfig": "gpuformers.quantization.compressed_tensors",
    "Mxfp4Config": "gpuformers.quantization.mxfp4",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuformers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
