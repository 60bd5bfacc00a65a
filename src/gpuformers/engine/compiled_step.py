"""CompiledDecoder: the engine step's decoder stack compiled once per model runner with torch.compile, dynamic in
the number of tokens of the step, attention and the KV-cache write as torch.library ops.

    model runner  ──prepare──> input_ids (1, total), position_ids (1, total), PagedContext (lists, counts, tensors)
                  ──paged_context(ctx)──> CompiledDecoder(input_ids, position_ids, PagedKVCache(ctx))
    compiled graph:  embed ─> [norm ─> q/k/v ─> rotary ─> paged_kv_write ─> paged_attention ─> o ─> MLP] x L ─> norm
                                                        (op, in place)     (op: reads the context's layout)

The graph sees the step only through tensors: the KV-cache write is `gpuformers::paged_kv_write` (it mutates the
layer's cache in place) and attention is `gpuformers::paged_attention`, which runs the eager paged attention
(engine/paged_attention.py) over the PagedContext the runner set for this thread. Dynamo therefore guards on
no Python value of the step (query offsets, context lengths, block tables as lists), which made an earlier try
recompile until Dynamo gave up. The token dimension is dynamic: one graph for every step size. A step of exactly one
token (batch-1 decoding) is padded to two rows, since Dynamo specializes sizes 0 and 1 and would compile a second
graph for it (each graph costs 10-40 s of a cold start; the padding row costs one row of each matmul).

On the CPU Inductor freezes the weights (generation/compiled_step.py's settings): the linear layers run on
oneDNN-packed weights, which the eager engine gets from kernels/cpu_linear.py's copies instead.

On CUDA with CUDA graphs on, each decode bucket's graph is captured over this compiled function
(engine/cuda_graphs.py: the capture calls the runner's `decode_hidden`, as an eager step does), so a replay launches
Inductor's kernels.

What stays eager: the LM head over the sampled rows (on a packed copy of its weight, `head_plan`), sampling, prompt
logprobs, LoRA steps (adapter rows are Python lists), hybrid (mamba) models, and models whose modules wait on the
host (the torch MoE block off the CPU; on the CPU its expert loop runs in the graph as one opaque op, layers/moe.py):
the runner's `decode_hidden` picks the compiled decoder or the eager one per step.
`decide_compile` says whether a runner compiles at all.

Offers: CompiledDecoder, decide_compile, head_plan, ENV.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.generation.compiled_step import CPU_INDUCTOR_SETTINGS
from gpuformers.engine.paged_attention import PagedKVCache
from gpuformers.kernels.cpu_linear import packable_linears, row_bucket
from gpuformers.kernels.cpu_matmul_probe import PACKED
from gpuformers.layers.moe import SparseMoeBlock, host_syncing_modules
from gpuformers.tensor_parallel import is_tensor_parallel

logger = logging.getLogger(__name__)
ENV = "GPUFORMERS_ENGINE_COMPILE"  # "1": compile=None compiles where the model allows it


def decide_compile(model: nn.Module, requested: bool | None, has_states: bool) -> tuple[bool, str]:
    """(whether the engine compiles its decoder, why). requested: ContinuousBatchingConfig.compile. True compiles
    or raises NotImplementedError naming why the model cannot be; None compiles only under
    GPUFORMERS_ENGINE_COMPILE=1 (where the model can be): compiling costs 20-60 s over the first steps of each
    process (less with Inductor's on-disk cache warm), which a short generate_batch() does not win back."""
    why_not = _why_not(model, has_states)
    if requested is False:
        return False, "compile=False"
    if requested is True:
        if why_not:
            raise NotImplementedError(f"ContinuousBatchingConfig(compile=True) cannot compile this model: {why_not}; "
                                      f"leave compile unset (or False) to run its steps eagerly")
        return True, "compile=True"
    if os.environ.get(ENV) == "1":
        if why_not:
            logger.info("%s=1, but the engine's steps run eagerly: %s", ENV, why_not)
        return not why_not, why_not or f"{ENV}=1"
    return False, f"compile=None: eager unless {ENV}=1"


def _why_not(model: nn.Module, has_states: bool) -> str:
    if has_states:
        # (the state mixing walks the step's prefill chunks and their slot rows as Python ints, engine/state_slots.py:
        # a graph would guard on that layout and recompile; it would need to be one op reading the step's StepStates,
        # as paged attention reads its PagedContext)
        return "a hybrid model's mamba layers keep per-sequence states outside the paged KV cache"
    if is_tensor_parallel(model):
        return ("a tensor-parallel model's all-reduces take its process group, which Inductor's weight freezing "
                "cannot hold (seen under torchrun: a compiled step failed on the group object)")
    # The torch MoE block reads its routing on the host; under torch.compile its expert loop runs as one opaque op
    # (layers/moe.py), which on the CPU costs nothing more. On CUDA the op's wait would stall every step and a CUDA
    # graph cannot hold it, so models with one stay eager there.
    syncing = host_syncing_modules(model)
    on_cpu = bool(syncing) and next(model.parameters()).device.type == "cpu"  # (asked only where it matters)
    for name in syncing:
        module = model.get_submodule(name)
        if not (on_cpu and isinstance(module, SparseMoeBlock) and module.outside_graph_key is not None):
            return (f"{name} reads values on the host in its forward (the torch MoE block off the CPU), which a "
                    f"graph cannot hold")
    return ""


def head_plan(model: nn.Module) -> list:
    """kernels/cpu_linear.py's plan for a compiled engine: a packed copy of the LM head alone (it runs eagerly,
    over the sampled rows; the decoder's weights are frozen into the graph). [] when the head cannot be packed."""
    head = getattr(model, "lm_head", None)
    return [([head], PACKED)] if any(layer is head for layer in packable_linears(model)) else []


class CompiledDecoder:
    """The decoder stack (model.model) compiled for engine steps; call it as the decoder inside paged_context().

    A step's tokens are padded up to row_bucket(total) (at most 25% more; none up to 8): oneDNN builds and keeps
    kernels per row count it meets, which took ~10 s over the first run of 48 requests (a new count at nearly every
    step) and grows a server's memory without end (kernels/cpu_linear.py's row_bucket). The padding rows are token 0
    at position 0, write their keys to `scratch_slot` (the runner's scratch block, never read) and no sequence
    attends to them; every other op of a layer is row-wise, so they touch no real row, and they are cut off after."""

    def __init__(self, decoder: nn.Module, scratch_slot: int):
        self.device = next(decoder.parameters()).device
        self.scratch_slot = scratch_slot
        # dynamic=True: the token dimension (and the block-table width the op reads) vary at every step.
        self.function = torch.compile(decoder.forward, dynamic=True)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past_key_values) -> torch.Tensor:
        """input_ids, position_ids (1, total) -> the final hidden states (1, total, hidden)."""
        total = input_ids.shape[1]
        padding = max(row_bucket(total), 2) - total  # never one row: a graph of its own (see the module's doc)
        if padding:
            context = past_key_values.context
            slots = torch.full((padding,), self.scratch_slot, dtype=context.slot_mapping.dtype,
                               device=context.slot_mapping.device)
            past_key_values = PagedKVCache(dataclasses.replace(
                context, slot_mapping=torch.cat([context.slot_mapping, slots])))
            input_ids = F.pad(input_ids, (0, padding))
            position_ids = F.pad(position_ids, (0, padding))
        inputs = dict(input_ids=input_ids, position_ids=position_ids, past_key_values=past_key_values)
        # specialize_float: under dynamic=True the modules' float attributes (norm eps, embedding norm_type, ...)
        # would become graph inputs, which Inductor then specializes after all, restarting Dynamo's whole trace
        # (18 of 108 s of a cold start at 100M parameters went to the discarded first attempt)
        with torch._dynamo.config.patch(specialize_float=True):
            if self.device.type != "cpu":
                hidden, _ = self.function(**inputs)
            else:
                with torch._inductor.config.patch(CPU_INDUCTOR_SETTINGS):
                    hidden, _ = self.function(**inputs)
        return hidden[:, :total]
