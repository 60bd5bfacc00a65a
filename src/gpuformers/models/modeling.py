"""PreTrainedModel: what every causal LM class shares: loading, saving, tied weights, attention backend choice,
and, through its mixins, generate() and continuous batching.

A model class names the class of its decoder layers once, in `decoder_layer_class` (or, for a family with more than
one kind of layer, `decoder_layer_classes`); `no_split_modules`, the tuple of their names that accelerate-style
device_map planning and FSDP's transformer_layer_cls_to_wrap take (transformers' `_no_split_modules`), is derived
from it, and layers/blocks.py finds the layers by isinstance.

Offers: PreTrainedModel, skip_init.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from gpuformers.engine.mixin import ContinuousBatchingMixin
from gpuformers.generation.generate import GenerationMixin
from gpuformers.layers.attention import AttentionInterface
from gpuformers.layers.blocks import checkpoint_decoder_layers, decoder_layers, uncheckpoint_decoder_layers
from gpuformers.lora.integration import PeftAdapterMixin
from gpuformers.models.config import ModelConfig
from gpuformers.models.embeddings import TokenEmbeddingsMixin

_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                   "trunc_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def skip_init():
    """Build modules without running their random initialisation (it is overwritten by the checkpoint, and on the
    meta device torch's init functions cost a second per model by importing the compiler stack)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class _ClassDerived:
    """A class attribute computed from what it is read on (the class, or an instance: whose own assignment then
    wins, as for any class attribute)."""

    def __init__(self, compute):
        self.compute = compute

    def __get__(self, instance, owner):
        return self.compute(owner if instance is None else instance)


class PreTrainedModel(nn.Module, GenerationMixin, ContinuousBatchingMixin, TokenEmbeddingsMixin, PeftAdapterMixin):
    config_class = ModelConfig
    # The class of the repeated block the stack is built of (LlamaDecoderLayer); None for a model without one.
    decoder_layer_class: type[nn.Module] | None = None
    # Every class whose instances are decoder layers (layers/blocks.py); a family with more than one kind of layer
    # sets the tuple itself.
    decoder_layer_classes: tuple[type[nn.Module], ...] = _ClassDerived(
        lambda model: () if model.decoder_layer_class is None else (model.decoder_layer_class,))
    # Their names, as transformers' _no_split_modules: what device_map keeps whole and FSDP shards one by one.
    no_split_modules: tuple[str, ...] = _ClassDerived(
        lambda model: tuple(cls.__name__ for cls in model.decoder_layer_classes))
    # Checkpoint keys that fan out into several of our parameters (loading/fan_out.py: transformers' fused MoE
    # experts); none for a model whose parameters keep the checkpoint's names.
    checkpoint_fan_out: tuple = ()

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.attn_implementation = "sdpa"
        self.generation_config = None
        self.name_or_path = ""
        self.quantization_config = None  # a BitsAndBytesConfig / WeightOnlyConfig when loaded quantized

    @property
    def is_quantized(self) -> bool:
        return self.quantization_config is not None

    # How many positions a learned position table holds (GPT-2's wpe), else None: past them a token has no position
    # embedding to look up. Rotary models go on past max_position_embeddings.
    learned_positions: int | None = None

    def prompt_length_error(self, prompt_length: int) -> str | None:
        """Why a prompt of `prompt_length` tokens cannot run (longer than max_position_embeddings, which a rope
        other than "dynamic" does not extend), or None: what generate() and the engine both refuse."""
        limit = self.config.max_position_embeddings
        if prompt_length <= limit or self.config.rope_type == "dynamic":
            return None
        return (f"the prompt has {prompt_length} tokens but the model handles at most max_position_embeddings="
                f"{limit} positions (rope_type {self.config.rope_type!r} does not extend beyond them); shorten the "
                f"prompt, e.g. tokenizer(..., truncation=True, max_length={limit})")

    def dequantize(self, dtype: torch.dtype | None = None) -> "PreTrainedModel":
        """Turn every quantized layer back into a float one in `dtype` (default: the model's), in place; the model is
        then unquantized and saves so (quantization/dequantize.py). Returns the model, as transformers' does."""
        from gpuformers.quantization.dequantize import dequantize_model

        return dequantize_model(self, dtype)

    # --- loading and saving ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **kwargs) -> "PreTrainedModel":
        """Load a Hugging Face checkpoint; see AutoModelForCausalLM.from_pretrained for the arguments."""
        from gpuformers.models.auto import load_pretrained

        return load_pretrained(name_or_path, model_class=cls, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write config.json, safetensors weights (sharded with an index above max_shard_size) and
        generation_config.json in the format transformers reads. `state_dict` replaces the model's own (e.g. the
        gathered weights of a model sharded by FSDP2). A tensor-parallel model gathers its slices into whole
        weights (every process must call this: a collective) and process 0 writes them. A model with an adapter
        (add_adapter / load_adapter) writes the adapter alone, in peft's format, as transformers does."""
        if self._hf_peft_config_loaded:
            return self._save_adapter(save_directory, state_dict)
        from gpuformers.distributed import full_model_state_dict, is_main_process
        from gpuformers.loading.save import save_checkpoint
        from gpuformers.tensor_parallel import is_tensor_parallel

        if is_tensor_parallel(self) and state_dict is None:
            state_dict = full_model_state_dict(self)
            if not is_main_process():
                return
        generation = self.generation_config.to_dict() if self.generation_config is not None else None
        save_checkpoint(
            self if state_dict is None else state_dict,
            save_directory,
            config=self.config.to_dict(),
            generation_config=generation,
            max_shard_size=max_shard_size,
            tied=self.tied_weights,
        )

    @property
    def tied_weights(self) -> dict[str, str]:
        """target parameter name -> source parameter name, for weights stored once and used twice."""
        return {}

    def tie_weights(self) -> None:
        for target, source in self.tied_weights.items():
            module_name, _, attr = target.rpartition(".")
            setattr(self.get_submodule(module_name), attr, self.get_parameter(source))

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute non-persistent buffers (rotary frequencies) on `device`, after a meta-device build."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers(device)

    def train(self, mode: bool = True):
        super().train(mode)
        if getattr(self, "_kernel_state", None) is not None:  # use_kernels=True: the kernels for the new mode
            from gpuformers.kernels.mapping import rekernelize

            rekernelize(self)
        return self

    # --- attention backend ----------------------------------------------------------------------------------

    def set_attn_implementation(self, name: str) -> None:
        """Switch every attention layer to the backend registered under `name` ("eager", "sdpa", ...)."""
        fn = AttentionInterface.get(name)
        for module in self.modules():
            if hasattr(module, "attention_fn"):
                module.attention_fn = fn
        self.attn_implementation = name

    # --- activation checkpointing -------------------------------------------------------------------------

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute each decoder layer's activations in the backward instead of keeping them, as transformers'
        activation_checkpointing_enable: torch.utils.checkpoint with `activation_checkpointing_kwargs` (default
        use_reentrant=False), every `every_n_layers`-th layer, `offload` keeping the saved inputs in host memory.
        Also makes the input embeddings' output require grad (enable_input_require_grads), so that a model whose
        embeddings are frozen (LoRA) still gets gradients through reentrant checkpointing."""
        kwargs = activation_checkpointing_kwargs
        kwargs = {"use_reentrant": False} if kwargs is None else kwargs
        checkpoint_decoder_layers(self, "activation_checkpointing", every_n_layers=every_n_layers, offload=offload,
                                  **kwargs)
        self.enable_input_require_grads()

    def activation_checkpointing_disable(self) -> None:
        uncheckpoint_decoder_layers(self)

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(getattr(layer, "_checkpointed", False) for layer in decoder_layers(self))

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """transformers' older name for activation_checkpointing_enable."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """transformers' older name for activation_checkpointing_disable."""
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    # --- facts ----------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        for p in self.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        seen, total = set(), 0
        skip = {id(self.get_input_embeddings().weight)} if exclude_embeddings else set()
        for p in self.parameters():
            if id(p) not in seen and id(p) not in skip:
                seen.add(id(p))
                total += p.numel()
        return total

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """Bytes held by the model's parameters (each shared tensor once) and, with return_buffers, its buffers,
        as transformers counts them: a quantized weight counts its packed bytes."""
        tensors = list(self.parameters()) + (list(self.buffers()) if return_buffers else [])
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())

    def get_input_embeddings(self) -> nn.Module:
        raise NotImplementedError
