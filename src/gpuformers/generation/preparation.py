"""GenerationPreparation: what `generate()` does once before decoding, as methods of the model (the base class of
GenerationMixin): merge the generation config with the call's kwargs, check the prompt, fix the length, and set up
the KV cache and the function each decode step calls.

Static cache: `cache_implementation="static"` preallocates keys and values for prompt + new tokens (StaticCache).
On CUDA, for a model with `supports_compiled_decode`, the decode step gets fixed shapes and is compiled with
`torch.compile(mode="reduce-overhead")` (CUDA graphs) unless `disable_compile=True`, as transformers does.
Elsewhere it runs eagerly and attends over the written slots only, which makes it no slower than the dynamic cache.

CPU matmuls: an eager generate() on the CPU runs its float32 linear layers on oneDNN-packed copies of their weights
where this machine runs those faster than F.linear (kernels/cpu_linear.py: measured once per process, kept with
the model while they take at most a quarter of the free RAM, at batch 1 half the weights; none in one_shot(), the
CLI's one answer; GPUFORMERS_CPU_PACKED_ROWS=none turns them off).

Offers: GenerationPreparation (_prepare_generation_config, _prepare_prompt, _infer_attention_mask,
_prepare_max_length, _refuse_cache_rebuild, _prepare_cache, _compiles_decode, _decode_forward, _cpu_matmuls).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import warnings

import torch

from gpuformers.device import is_offloaded
from gpuformers.generation.cache import Cache, DynamicCache, StaticCache
from gpuformers.generation.compiled_step import CompiledStep, key_of, liftable, lifted_host_waits
from gpuformers.generation.config import CompileConfig, GenerationConfig

# The cache implementations generate() builds itself.
_CACHES = {"dynamic": DynamicCache, "static": StaticCache}


class GenerationPreparation:
    """The preparation steps of `generate()`. Mixed into the model through GenerationMixin, whose model provides
    config, generation_config, forward(), get_input_embeddings(), and the hooks supports_compiled_decode and
    cache_must_be_rebuilt (GenerationMixin documents them)."""

    def _prepare_generation_config(self, generation_config, kwargs: dict) -> GenerationConfig:
        """model.generation_config (or defaults from the model config) < generation_config < kwargs."""
        base = getattr(self, "generation_config", None)
        if base is None:
            base = GenerationConfig.from_model_config(self.config)
        if generation_config is not None:
            config = generation_config.merged_with(base, none_is_unset=True)
        else:
            config = base.copy()
        unknown = config.update(**kwargs)
        if config.cache_implementation == "hybrid":
            # Checkpoints with sliding-window layers (Gemma 2 / 3) ship "hybrid", which transformers now reads, from
            # wherever it comes, as the default dynamic cache (it handles the windows); so do we.
            config.cache_implementation = None
        if unknown:
            hints = []
            for name in sorted(unknown):
                close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(GenerationConfig)], n=1)
                hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
            raise TypeError(
                f"generate() got arguments that are neither GenerationConfig fields nor inputs: {', '.join(hints)}; "
                f"inputs are inputs/input_ids, attention_mask, past_key_values, streamer, tokenizer, "
                f"logits_processor, stopping_criteria, prefix_allowed_tokens_fn"
            )
        return config

    def _prepare_prompt(self, inputs, input_ids, attention_mask, config: GenerationConfig):
        if inputs is not None and input_ids is not None:
            raise ValueError("pass the prompt once: either as the first argument (inputs) or as input_ids=, not both")
        ids = inputs if inputs is not None else input_ids
        device = self.get_input_embeddings().weight.device
        if ids is None:
            if config.bos_token_id is None:
                raise ValueError("generate() needs a prompt (input_ids) or a bos_token_id to start from")
            ids = torch.full((1, 1), config.bos_token_id, dtype=torch.long, device=device)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(
                f"input_ids must be a (batch, seq) tensor of token ids, got {shape}; "
                f"use tokenizer(text, return_tensors='pt').input_ids (add [None] to a 1-D tensor)"
            )
        if ids.shape[1] == 0:
            raise ValueError("input_ids is empty (no prompt tokens); give at least one token, e.g. the bos token")
        for name, tensor in (("input_ids", ids), ("attention_mask", attention_mask)):
            if tensor is not None and tensor.device != device:
                raise ValueError(
                    f"{name} is on {tensor.device} but the model's embeddings are on {device}; "
                    f"move it with {name}.to(model.device)"
                )
        if attention_mask is not None and attention_mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(ids.shape)}; "
                f"they must match (pass the mask the tokenizer returned with these ids)"
            )
        error = self.prompt_length_error(ids.shape[1])
        if error:
            raise ValueError(error)
        return ids.long(), attention_mask

    @staticmethod
    def _infer_attention_mask(input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor | None:
        """transformers' rule without a mask: pad tokens in the prompt are padding, unless pad is also eos."""
        pad = config.pad_token_id
        if pad is None or pad in config.eos_token_ids:
            return None
        return (input_ids != pad).long()

    def _prepare_max_length(self, config: GenerationConfig, prompt_length: int) -> int:
        """The total length (prompt + new tokens) this call stops at, written into `config` as max_length (with
        max_new_tokens cleared), once: the stop criteria and the loop bounds read it from there."""
        max_length = config.max_length_for(prompt_length, self.position_limit)
        if max_length <= prompt_length:
            raise ValueError(
                f"max_length={max_length} leaves no room for new tokens after a prompt of {prompt_length} tokens; "
                f"set max_new_tokens instead"
            )
        positions = self.learned_positions
        if positions is not None and max_length - 1 > positions:
            # the last new token is never fed back, so max_length - 1 positions are looked up
            raise ValueError(
                f"a prompt of {prompt_length} tokens generated up to max_length={max_length} needs {max_length - 1} "
                f"positions, but {type(self).__name__} has learned positions for {positions} "
                f"(max_position_embeddings); ask for at most {positions + 1 - prompt_length} new tokens"
            )
        config.max_new_tokens = None
        config.max_length = max_length
        return max_length

    def _refuse_cache_rebuild(self, assistant_model, prompt_length: int, max_length: int) -> None:
        """Assisted generation does not rebuild a cache (cache_must_be_rebuilt): refuse a call that would need it."""
        for role, m in (("model", self), ("assistant_model", assistant_model)):
            if m is not None and m.cache_must_be_rebuilt(prompt_length, max_length):
                raise NotImplementedError(
                    f"assisted generation cannot take {role} {type(m).__name__} from {prompt_length} to {max_length} "
                    f"tokens: on the way its cache must be recomputed (cache_must_be_rebuilt; Phi-3's longrope past "
                    f"original_max_position_embeddings), which assisted generation does not do; generate without "
                    f"assistant_model / prompt_lookup_num_tokens, or keep max_length at or below that length"
                )

    def _prepare_cache(self, cache, config: GenerationConfig, rows: int, max_length: int) -> Cache | None:
        if cache is not None:
            if not isinstance(cache, Cache):
                raise TypeError(f"past_key_values must be a gpuformers Cache, got {type(cache).__name__}")
            return cache
        if not config.use_cache:
            return None
        name = config.cache_implementation or "dynamic"
        if name not in _CACHES:
            raise ValueError(
                f"cache_implementation {name!r} is not supported by generate(); supported: {', '.join(_CACHES)}"
            )
        if name == "dynamic":
            return self.make_cache()
        if self.is_stateful:
            raise NotImplementedError(
                f"cache_implementation={name!r} is not implemented for {type(self).__name__}, a state-space model: "
                f"its recurrent cache is already of fixed size, but a compiled decode step over it is not written "
                f"yet; leave cache_implementation unset (the dynamic default)")
        size = config.max_cache_len or max_length
        if size < max_length:
            raise ValueError(
                f"max_cache_len={size} is smaller than the {max_length} tokens this call can reach; "
                f"raise max_cache_len or lower max_new_tokens"
            )
        # Fixed shapes only pay off when the step is compiled; eagerly, reading the written prefix is cheaper.
        if not self._compiles_decode(config):
            return StaticCache(self.config, max_cache_len=size, max_batch_size=rows, fixed_shape=False)
        # The compiled step's cache is kept on the model and emptied for the next call, as transformers keeps its
        # own: its buffers are marked as static addresses (kept alive by torch until torch._dynamo.reset(), so a
        # new cache per call would leak device memory) and a new address makes CUDA graphs re-record the step.
        kept = self.__dict__.get("_static_cache")
        if kept is not None and _reusable(kept, rows, size, self.get_input_embeddings().weight):
            kept.reset()
            return kept
        cache = StaticCache(self.config, max_cache_len=size, max_batch_size=rows, fixed_shape=True)
        self.__dict__["_static_cache"] = cache  # (not a submodule, not a buffer: never saved or moved)
        return cache

    def _compiles_decode(self, config: GenerationConfig) -> bool:
        """transformers' auto-compile rule, less the cache: on CUDA unless disable_compile=True, for a model that
        supports it (the step is then compiled when its cache is a fixed-shape StaticCache). On other devices only
        when the caller passes a compile_config: compiling costs about a minute there, worth it for long runs."""
        device = self.get_input_embeddings().weight.device
        if config.disable_compile or (device.type != "cuda" and config.compile_config is None):
            return False
        if is_offloaded(self):
            # Offloaded weights stream in through hooks at every forward, which CUDA graphs cannot replay (transformers
            # does not compile such a model either): the static cache runs eagerly.
            return False
        method = getattr(self.quantization_config, "quant_method", None)
        if method in _NOT_COMPILED:
            # transformers compiles only quantization methods whose quantizer says it can (is_compileable)
            if config.compile_config is not None:
                warnings.warn(f"a {method} quantized model's decode step is not compiled (as in transformers): the "
                              f"static cache runs without CUDA graphs", UserWarning, stacklevel=4)
            return False
        if not self.supports_compiled_decode and not _supported_when_lifted(self, device):
            warnings.warn(
                f"{type(self).__name__} does not support a compiled decode step yet (supports_compiled_decode is "
                f"False): the static cache runs without CUDA graphs; pass disable_compile=True to silence this",
                UserWarning, stacklevel=4)
            return False
        return True

    def _decode_forward(self, config: GenerationConfig, cache: Cache | None):
        """The function a decode step calls: the model itself, or the model compiled for CUDA graphs when
        _compiles_decode says so and the cache has fixed shapes. The compiled function is kept on the model so a
        second generate() call reuses it."""
        if not (isinstance(cache, StaticCache) and cache.fixed_shape and self._compiles_decode(config)):
            return self
        options = config.compile_config or CompileConfig()
        compiled = getattr(self, "_compiled_decode", None)
        if compiled is None or compiled.key != key_of(options) or not compiled.still_valid(self):
            compiled = CompiledStep(self, options)
            self._compiled_decode = compiled
        return compiled

    def _cpu_matmuls(self, forward, rows: int | None):
        """The context generate() decodes in, `rows` rows per step: kernels/cpu_linear.py's copies of the weights
        for an eager forward (they pay for float32 linear layers on the CPU), else nothing."""
        from gpuformers.kernels.cpu_linear import cpu_matmuls

        return cpu_matmuls(self, rows) if forward is self else contextlib.nullcontext()


# Quantization methods whose layers transformers does not compile (its quantizers' is_compileable is False): their
# matmuls call into packages (bitsandbytes, GPTQ/AWQ kernels) or unpack per call (MXFP4) in ways torch.compile breaks
# its graph on. Weight-only, FP8 and compressed-tensors layers compile.
_NOT_COMPILED = frozenset({"bitsandbytes", "gptq", "awq", "mxfp4"})


def _supported_when_lifted(model, device: torch.device) -> bool:
    """Whether the model supports a compiled decode step once its MoE blocks run outside the graph (the CPU only:
    compiled_step.lifted_host_waits)."""
    modules = liftable(model)
    if device.type != "cpu" or not modules:
        return False
    with lifted_host_waits(modules):
        return model.supports_compiled_decode


def _reusable(cache: StaticCache, rows: int, size: int, embeddings: torch.Tensor) -> bool:
    """Whether a kept fixed-shape StaticCache serves a call of `rows` rows up to `size` tokens: the same batch, room
    enough, buffers on the device and in the dtype of the model's embeddings (a model moved or cast since gets a new
    cache), and buffers it may write in place here (inference tensors, made by a generate() whose loop ran in
    inference mode, only inside inference mode, and only they there)."""
    keys = cache.key_cache[0]
    if keys is None or cache.max_batch_size != rows or cache.max_cache_len < size:
        return False
    if keys.device != embeddings.device or keys.dtype != embeddings.dtype:
        return False
    return keys.is_inference() == torch.is_inference_mode_enabled()
