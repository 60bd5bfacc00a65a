"""The engine's settings (ContinuousBatchingConfig, resolved for a model: the KV cache sized from free memory, CUDA
graphs and async batching decided by the device) and each request's SamplingParams from a GenerationConfig, with
the GenerationConfig fields the engine does not honour refused by name.

Offers: ContinuousBatchingConfig, sampling_params_from, unhonoured_fields, check_honoured, free_memory,
decide_prepack, check_one_device.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from gpuformers.device import mapped_devices
from gpuformers.engine.compiled_step import decide_compile
from gpuformers.engine.cuda_graphs import decide_cuda_graph
from gpuformers.engine.model_runner import kv_bytes_per_block, step_workspace_bytes
from gpuformers.engine.scheduler import SCHEDULER_TYPES
from gpuformers.engine.sequence import SamplingParams
from gpuformers.engine.state_slots import attention_layer_indices, has_mamba_layers, state_rows_bytes
from gpuformers.kernels.cpu_linear import available_ram, copies_fit, packable_linears
from gpuformers.kernels.cpu_matmul_probe import packs_some_rows, prepack_available
from gpuformers.sizes import format_size

_CPU_CACHE_CAP = 2 << 30  # bytes: on the CPU the cache comes out of the same RAM as everything else
# Blocks of a model without attention layers (Mamba2): they take no memory, only count tokens and carry the prefix
# hashes; this many hold 512k tokens of 64 (2M of 256)
_STATE_ONLY_BLOCKS = 8192


@dataclass
class ContinuousBatchingConfig:
    """Engine settings; None means decided from the device at start-up (see `resolve`)."""

    block_size: int | None = None  # tokens per block: 256 on a GPU, 64 on the CPU; any power of two
    num_blocks: int | None = None  # default: from free memory times max_memory_percent
    max_batch_tokens: int | None = None  # tokens computed per step (decodes + prefill chunks)
    max_memory_percent: float = 0.9
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True  # prefix caching
    use_async_batching: bool | None = None  # default: on with CUDA (True on the CPU works, with nothing to overlap)
    use_cuda_graph: bool | None = None
    # CPU only: a oneDNN-packed copy of each float32 linear weight for the matmuls of a step at the row counts
    # where this machine runs it faster (kernels/cpu_linear.py). Default: on when it is faster at some row count
    # and the copies take at most a quarter of the free RAM.
    prepack_weights: bool | None = None
    # torch.compile the decoder stack for the steps (engine/compiled_step.py): attention and the KV-cache write as
    # ops, the token dimension dynamic; costs 20-60 s over the first steps (Inductor's on-disk cache makes later
    # starts cheaper). None: off for now (decide_compile); True raises for a model that cannot be compiled.
    compile: bool | None = None
    scheduler_type: str = "fifo"
    # A model with mamba layers: how many prefix-cache snapshots of their states to keep (engine/state_slots.py);
    # each takes one sequence's state. Default: max_requests_per_batch // 8, at least 4 (0 without block sharing).
    num_state_snapshots: int | None = None
    return_logprobs: bool = False
    # Seeds the run: each sampled request without a seed of its own gets one drawn from random.Random(seed) when it
    # is added, so a run repeats and identical prompts still get different samples. None: torch's global generator.
    seed: int | None = None

    def __post_init__(self):
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"scheduler_type {self.scheduler_type!r} is not one of: {', '.join(SCHEDULER_TYPES)}")
        if not 0 < self.max_memory_percent <= 1:
            raise ValueError(f"max_memory_percent={self.max_memory_percent} must be in (0, 1]")
        for name in ("block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int (or None for automatic)")
        snapshots = self.num_state_snapshots
        if snapshots is not None and (not isinstance(snapshots, int) or isinstance(snapshots, bool) or snapshots < 0):
            raise ValueError(f"num_state_snapshots={snapshots!r} must be an int >= 0 (or None for automatic)")
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (16, 32, ..., 256)")

    def resolve(self, model) -> "ContinuousBatchingConfig":
        """A copy with every automatic setting decided for this model on its device."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        check_one_device(model)
        cuda = model.device.type == "cuda"
        values["block_size"] = self.block_size or (256 if cuda else 64)
        # 8192 on a GPU, vLLM's default: a prefill step long enough that the host's launches (the eager forward) hide
        # behind its matmuls, while a decode batch waits at most one such step
        values["max_batch_tokens"] = self.max_batch_tokens or (8192 if cuda else 512)
        values["max_requests_per_batch"] = self.max_requests_per_batch or (256 if cuda else 128)
        stateful = has_mamba_layers(model)
        if not stateful or not values["allow_block_sharing"]:
            values["num_state_snapshots"] = 0
        elif self.num_state_snapshots is None:
            values["num_state_snapshots"] = max(4, values["max_requests_per_batch"] // 8)
        tp_size = getattr(model, "tp_size", 1)
        if self.num_blocks is None:
            values["num_blocks"], sizes = self._blocks_that_fit(model, values, tp_size)
            if tp_size > 1:  # every process must schedule (and preempt) alike: the smallest cache of them all
                from gpuformers.distributed import all_reduce_min

                values["num_blocks"] = all_reduce_min(values["num_blocks"], model.device)
            if values["num_blocks"] < 1:  # (after the all-reduce: every process raises, none waits in it)
                raise ValueError(f"no KV cache block fits on {model.device}: {sizes}; free memory there (another "
                                 f"process may hold it), raise max_memory_percent, lower block_size, max_batch_tokens "
                                 f"or max_requests_per_batch, or set num_blocks")
        if self.use_cuda_graph and not cuda:
            raise ValueError("use_cuda_graph=True needs the model on a CUDA device; leave it None for automatic")
        if self.use_cuda_graph and tp_size > 1:
            raise NotImplementedError("CUDA graphs with tensor parallelism (collectives inside a captured graph) are "
                                      "not supported yet; leave use_cuda_graph None (off under tp_plan)")
        values["use_cuda_graph"] = decide_cuda_graph(self.use_cuda_graph, model, cuda, tp_size)
        values["prepack_weights"] = decide_prepack(self.prepack_weights, model, tp_size)
        values["compile"], _ = decide_compile(model, self.compile, stateful)
        # On the CPU the "device" work runs in the calling thread, so there is nothing to overlap it with.
        values["use_async_batching"] = cuda if self.use_async_batching is None else bool(self.use_async_batching)
        return ContinuousBatchingConfig(**values)

    def _blocks_that_fit(self, model, values: dict, tp_size: int) -> tuple[int, str]:
        """(blocks, how they were counted): the KV cache takes at most max_memory_percent of the free memory, and on
        a GPU leaves a step's workspace free; one block of it is the model runner's scratch block."""
        num_layers = len(attention_layer_indices(model))
        per_block = kv_bytes_per_block(model.config, values["block_size"], model.dtype, tp_size, num_layers)
        if not per_block:  # no layer keeps keys and values (Mamba2): blocks only count tokens for prefix caching
            return _STATE_ONLY_BLOCKS, "no attention layers: blocks hold no keys and values"
        cuda = model.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()  # memory torch's allocator holds unused (loading's leftovers) counts as free
        free = free_memory(model.device)
        budget = int(free * self.max_memory_percent)
        sizes = f"{format_size(free)} free, max_memory_percent={self.max_memory_percent} of it {format_size(budget)}"
        if has_mamba_layers(model):  # the mamba layers' state slots come out of the same budget
            # (+ 1: the pool's scratch row, stepped by CUDA-graph padding rows)
            states = state_rows_bytes(model, values["max_requests_per_batch"] + values["num_state_snapshots"] + 1)
            budget -= states
            sizes += (f", of which {format_size(states)} for the state slots of {values['max_requests_per_batch']} "
                      f"sequences and {values['num_state_snapshots']} prefix snapshots")
        if cuda:  # (on the CPU, _CPU_CACHE_CAP leaves the RAM for the rest)
            workspace = step_workspace_bytes(model.config, values["max_batch_tokens"],
                                             values["max_requests_per_batch"], model.dtype, tp_size)
            budget = min(budget, free - workspace)
            sizes += f" and {format_size(workspace)} stays free for a step's activations and logits"
        sizes += f"; one block of {values['block_size']} tokens takes {format_size(per_block)} (plus the scratch one)"
        return max(0, budget // per_block - 1), sizes


def check_one_device(model) -> None:
    """NotImplementedError for a model that device_map spread over several devices (or offloaded): the engine keeps
    its KV cache and step inputs on one device, model.device, and the layers placed elsewhere would not find them."""
    placed = sorted(mapped_devices(model))
    if len(placed) > 1:
        raise NotImplementedError(
            f"the model is spread over {placed} by device_map; the continuous batching engine runs a model on one "
            f"device: load it with device_map=\"cuda\" (one GPU), or over several GPUs with tp_plan=\"auto\" under "
            f"torchrun (tensor parallelism)")


def decide_prepack(asked: bool | None, model, tp_size: int) -> bool:
    """prepack_weights for this model: False when asked so; else on for float32 linear layers on the CPU in one
    process with oneDNN, automatically only while their packed copies take at most a quarter of the free RAM;
    asked True where it cannot apply is a ValueError saying why."""
    if asked is False:
        return False
    linears = packable_linears(model)
    why_not = None
    if model.device.type != "cpu":
        why_not = f"the model is on {model.device}; packed weights are for the CPU"
    elif tp_size > 1:
        why_not = "the model is split by tensor parallelism"
    elif not prepack_available():
        why_not = "this torch build has no oneDNN (torch.backends.mkldnn)"
    elif not linears:
        why_not = "the model has no float32 nn.Linear layers"
    if why_not is not None:
        if asked:
            raise ValueError(f"prepack_weights=True: {why_not}; leave it None for automatic")
        return False
    if asked:
        return True
    return copies_fit(sum(layer.weight.numel() * layer.weight.element_size() for layer in linears)) \
        and packs_some_rows()


def free_memory(device: torch.device, cap: bool = True) -> int:
    """Free bytes on `device`; on the CPU at most _CPU_CACHE_CAP when `cap` (what the KV cache may be sized from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    available = available_ram() or _CPU_CACHE_CAP
    return min(available, _CPU_CACHE_CAP) if cap else available


# GenerationConfig fields that change generate()'s tokens and that the engine does not implement, each with the test
# of "set so that it matters" (generate()'s own: build_logits_processors, beam search, stopping criteria). Fields
# left out are honoured (SamplingParams), inert here (beam-only length_penalty and early_stopping, assistant
# settings, pad and bos ids, return_dict_in_generate) or change speed only (use_cache, cache_implementation,
# compile_config, prompt_lookup_num_tokens, which gives the same tokens).
_UNHONOURED = {
    "num_beams": lambda c: c.num_beams > 1,
    "num_return_sequences": lambda c: c.num_return_sequences > 1,
    "no_repeat_ngram_size": lambda c: c.no_repeat_ngram_size > 0,
    "bad_words_ids": lambda c: c.bad_words_ids is not None,
    "forced_bos_token_id": lambda c: c.forced_bos_token_id is not None,
    "forced_eos_token_id": lambda c: c.forced_eos_token_id is not None,
    "suppress_tokens": lambda c: c.suppress_tokens is not None,
    "begin_suppress_tokens": lambda c: c.begin_suppress_tokens is not None,
    "remove_invalid_values": lambda c: c.remove_invalid_values,
    "typical_p": lambda c: c.do_sample and c.typical_p < 1.0,
    "epsilon_cutoff": lambda c: c.do_sample and 0.0 < c.epsilon_cutoff < 1.0,
    "eta_cutoff": lambda c: c.do_sample and 0.0 < c.eta_cutoff < 1.0,
    "top_h": lambda c: c.do_sample and c.top_h is not None,
    "sequence_bias": lambda c: c.sequence_bias is not None,
    "exponential_decay_length_penalty": lambda c: c.exponential_decay_length_penalty is not None,
    "stop_strings": lambda c: c.stop_strings is not None,
    "max_time": lambda c: c.max_time is not None,
    "output_scores": lambda c: c.output_scores,
    "output_logits": lambda c: c.output_logits,
    "output_attentions": lambda c: c.output_attentions,
    "output_hidden_states": lambda c: c.output_hidden_states,
}


def unhonoured_fields(generation_config) -> list[str]:
    """The fields of `generation_config` that would change generate()'s tokens and that the engine does not
    implement (see _UNHONOURED)."""
    return [name for name, matters in _UNHONOURED.items() if matters(generation_config)]


def check_honoured(generation_config) -> None:
    """Raise NotImplementedError naming each field of `generation_config` the engine would not honour."""
    unhonoured = [f"{name}={getattr(generation_config, name)!r}" for name in unhonoured_fields(generation_config)]
    if unhonoured:
        raise NotImplementedError(
            f"the continuous batching engine does not implement generation config field(s) {', '.join(unhonoured)}; "
            f"leave them at their defaults, or use model.generate() (per-token scores: return_logprobs=True; "
            f"stop strings: stop=[token ids])")


def sampling_params_from(generation_config, cb_config: ContinuousBatchingConfig, prompt_length: int,
                         max_position_embeddings: int | None = None, **overrides) -> SamplingParams:
    """Per-request SamplingParams: the generation config's values, then this request's overrides. Raises
    NotImplementedError naming the generation config's fields that would change the tokens and that the engine
    does not implement (check_honoured). max_position_embeddings: the model's; it caps the default length (20 new
    tokens) as in generate()."""
    config = generation_config
    check_honoured(config)
    max_new = overrides.pop("max_new_tokens", None)
    if max_new is None:
        max_length = config.max_length_for(prompt_length, max_position_embeddings)
        if max_length <= prompt_length:
            raise ValueError(f"max_length={max_length} leaves no room for new tokens after a prompt of "
                             f"{prompt_length} tokens; set max_new_tokens instead")
        max_new = max_length - prompt_length
    values = dict(
        max_new_tokens=max_new,
        do_sample=config.do_sample,
        temperature=config.temperature,
        top_k=config.top_k or 0,
        top_p=config.top_p,
        min_p=config.min_p or 0.0,
        repetition_penalty=config.repetition_penalty,
        min_new_tokens=max(0, config.min_length_for(prompt_length) - prompt_length),  # min_length counts the prompt
        eos_token_ids=tuple(config.eos_token_ids),
        return_logprobs=cb_config.return_logprobs,
    )
    unknown = set(overrides) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise TypeError(f"unknown request settings: {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(f.name for f in fields(SamplingParams))}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)
