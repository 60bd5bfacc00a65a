"""CompiledStep: the decode step generate() compiles over a fixed-shape StaticCache, with the settings that make it
fast on each device, kept on the model for its next calls.

The step is `torch.compile(model.forward)` with the CompileConfig's arguments. On the CPU, Inductor also gets

- weight freezing (`torch._inductor.config.freezing`): the linear weights become constants of the graph, so that
  Inductor can lay them out once instead of at every call. In float32 at a fixed row count it prepacks them for
  MKL (`mkl._mkl_linear`); at one row per step (batch-1 decoding) that matmul reads a weight ~1.3-2x faster than
  `F.linear` on the weight as nn.Linear keeps it (which MKL repacks at every call);
- `cpp.enable_concat_linear`: sibling matmuls of one input (q/k/v, gate/up) become one matmul over their weights
  concatenated at freezing, as kernels/cpu_linear.py does for eager steps.

Freezing is decided by Dynamo while it traces (it makes the parameters graph attributes only when
`torch._inductor.config.freezing` is set then, and grad mode is off, as in generate()), so the setting is patched in
around each call of the step rather than passed as a torch.compile option (those reach Inductor only).

What freezing costs:
- memory: each compiled graph keeps its own packed copy of the linear weights (the model's own weights stay for
  prefill and everything else): a second copy of the linear weights per graph, i.e. per batch size and cache size
  until Dynamo makes those dimensions dynamic (its automatic dynamic shapes, after a second size);
- staleness: the constants are copies, so a weight changed in place after compiling (load_state_dict, an
  optimizer step, a merged adapter) would not be seen. The step records the parameters' version counters and
  storages when it is built and, at the next generate() call, drops its compiled code (of every model of that
  class: Dynamo keeps it per function) when one of them moved; the step then compiles again.

On CUDA nothing is added: the CompileConfig's mode ("reduce-overhead": CUDA graphs) is what pays there.

Mixture-of-experts blocks on the CPU: SparseMoeBlock's torch `run_experts` reads which experts got tokens on the
host (`.tolist()`), which a graph cannot hold. The compiled step gives each such block a run_experts of its own
(`install_gathered_experts`, once: installed and removed around each step, it changed the blocks' __dict__ at every
step, which defeats Dynamo's dict-tag guard shortcut: its guard check took 1.2-2.4 ms per step against 0.9-1.3 ms,
three alternated runs each at load ~3; the rest of that check is the ~270 parameters' guards). Outside a compiled graph, or with grad, it is the block's own; inside a
compiled inference graph it is decided by shape while Dynamo traces:

- few assignments (tokens * top_k <= experts, batch-1 decoding) and gated experts of plain nn.Linear layers: the
  experts gathered, no host sync. The expert weights stacked in the graph, (experts, 2 * intermediate, hidden) and
  (experts, hidden, intermediate) (a constant that freezing folds once, like the dense layers' packed copies),
  each assignment's expert picked with index_select and both projections run as batched matmuls of one row:

      gate_up[a] = x[t] @ w13[e_a]^T  (T*k, 1, 2I);   y[a] = (silu(gate) * up)[a] @ w2[e_a]^T  (T*k, 1, H)
      out[t]     = sum over k of y[t, k] * weight[t, k]

  Inductor fuses the whole block (router, gather, matmuls) with the layer around it; it reads top_k experts'
  weights per token, where computing every expert would read all of them. At the tiny shape of
  benchmarks/bench_decode_families.py this took qwen3_moe's block from ~230 to ~70 us (1 thread).
- otherwise (more assignments than experts, other experts): the block's own run_experts, which under torch.compile
  runs as one opaque op (layers/moe.py's `gpuformers::experts_outside_graph`: the loop called eagerly, its output
  shaped like its input), so the rest of the layer stays in one graph and the host wait happens inside the op.

Numbers: the same as eager in float32 up to the matmuls' summation order (tokens equal in the tests). The
installed run_experts stays on the blocks: a later torch.compile of the same model (the engine's compiled decoder)
gathers too, with a second graph for steps of more assignments than experts.

Offers: CompiledStep, CPU_INDUCTOR_SETTINGS, DYNAMO_SETTINGS, liftable, lifted_host_waits,
install_gathered_experts.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.generation.compile_config import CompileConfig
from gpuformers.layers.mlp import GatedMLP
from gpuformers.layers.moe import SparseMoeBlock, host_syncing_modules, register_outside_graph

# Inductor settings patched in around a CPU step (module docstring).
CPU_INDUCTOR_SETTINGS = {"freezing": True, "cpp.enable_concat_linear": True}
# Dynamo settings patched in around every step: the guards of a module whose __dict__ (and its submodules') did not
# change since the last check are skipped by comparing dict version tags; the tiny model's guard check per step fell
# from ~330 to ~200 us (of a ~4 ms step) with it.
DYNAMO_SETTINGS = {"use_recursive_dict_tags_for_guards": True}


class CompiledStep:
    """model.forward compiled with `options` (a CompileConfig), callable as the forward; one per model, kept while
    the options stay the same (`key`)."""

    def __init__(self, model: nn.Module, options: CompileConfig):
        self.key = key_of(options)
        kwargs = dict(fullgraph=options.fullgraph, dynamic=options.dynamic, backend=options.backend)
        # torch.compile accepts a mode or options, not both.
        kwargs.update(options=options.options) if options.options else kwargs.update(mode=options.mode)
        self.function = torch.compile(model.forward, **kwargs)
        device = model.get_input_embeddings().weight.device
        # (freezing only for Inductor: another backend, such as the tests' eager one, takes what Dynamo gives it)
        self.freezes = device.type == "cpu" and options.backend == "inductor"
        self.weights = _weights_state(model) if self.freezes else None
        self.code = model.forward.__func__.__code__
        install_gathered_experts(liftable(model))  # (MoE blocks, CPU only: module docstring)

    def still_valid(self, model: nn.Module) -> bool:
        """Whether the compiled step still computes with the model's weights (always, without freezing). When not,
        the compiled code of the model's forward is dropped (module docstring): the caller builds a new step."""
        if self.weights is None or _weights_state(model) == self.weights:
            return True
        torch._dynamo.reset_code(self.code)
        return False

    def __call__(self, **inputs):
        with torch._dynamo.config.patch(DYNAMO_SETTINGS):
            if not self.freezes:
                return self.function(**inputs)
            with torch._inductor.config.patch(CPU_INDUCTOR_SETTINGS):
                return self.function(**inputs)


def liftable(model: nn.Module) -> list[nn.Module]:
    """The blocks whose expert loop a compiled step holds without a host wait: on the CPU, the host-waiting
    SparseMoeBlocks; elsewhere none."""
    if model.get_input_embeddings().weight.device.type != "cpu":
        return []
    names = set(host_syncing_modules(model))
    return [m for name, m in model.named_modules() if name in names and isinstance(m, SparseMoeBlock)]


@contextlib.contextmanager
def lifted_host_waits(modules: list[nn.Module]):
    """While inside, `modules` (liftable's) do not count as waiting on the host (host_syncing_modules): what
    supports_compiled_decode answers for a compiled step, which holds their expert loop (module docstring)."""
    for module in modules:
        register_outside_graph(module)  # (a subclass that skipped SparseMoeBlock.__init__)
        module.syncs_host = False
    try:
        yield
    finally:
        for module in modules:
            module.__dict__.pop("syncs_host", None)


def install_gathered_experts(modules: list[nn.Module]) -> None:
    """Give each block (liftable's) the step's run_experts, once and for good: it is the block's own outside a
    compiled graph and with grad, so eager forwards and training see no change (installed per step, it slowed
    Dynamo's guard check: module docstring)."""
    for module in modules:
        register_outside_graph(module)
        if "run_experts" not in module.__dict__:
            module.run_experts = types.MethodType(_step_experts, module)


def _gatherable(block: nn.Module) -> bool:
    """Whether every expert is a GatedMLP of plain nn.Linear layers without bias (types only: it runs while Dynamo
    traces, which guards on them)."""
    return all(type(e) is GatedMLP and "forward" not in e.__dict__
               and all(type(m) is nn.Linear and m.bias is None for m in (e.gate_proj, e.up_proj, e.down_proj))
               for e in block.experts)


def _step_experts(block: nn.Module, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The installed run_experts: gathered inside a compiled inference graph when tokens * top_k <= experts and the
    experts allow it, else the block's own (under compile: its loop as one op)."""
    # (the CPU only: elsewhere no freezing folds the stacked weights, which would be copied at every step)
    if (torch.compiler.is_compiling() and not torch.is_grad_enabled() and x.device.type == "cpu"
            and experts.numel() <= len(block.experts) and _gatherable(block)):
        return _gathered_experts(block, x, weights, experts)
    return type(block).run_experts(block, x, weights, experts)


def _gathered_experts(block: nn.Module, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The experts gathered, no host sync (module docstring): x (tokens, hidden), weights / experts (tokens, top_k)
    -> (tokens, hidden)."""
    tokens, top_k = experts.shape
    # (experts, 2 * intermediate, hidden) and (experts, hidden, intermediate): constants folded by freezing
    w13 = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in block.experts])
    w2 = torch.stack([e.down_proj.weight for e in block.experts])
    intermediate = w2.shape[2]
    chosen = experts.reshape(-1)  # (tokens * top_k,): assignment a = t * top_k + k
    rows = x.repeat_interleave(top_k, dim=0)[:, None]  # (tokens * top_k, 1, hidden)
    gate_up = torch.bmm(rows, w13.index_select(0, chosen).transpose(1, 2))  # (tokens * top_k, 1, 2 * intermediate)
    act = F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]
    y = torch.bmm(act, w2.index_select(0, chosen).transpose(1, 2)).view(tokens, top_k, -1)  # (tokens, top_k, hidden)
    # weights may be float32 (Mixtral's router): the sum is rounded once, to the model dtype
    return (y * weights[..., None]).sum(dim=1).to(x.dtype)


def key_of(options: CompileConfig) -> tuple:
    """What identifies a CompileConfig's compiled step."""
    return tuple(sorted(options.to_dict().items(), key=str))


def _weights_state(model: nn.Module) -> list[tuple[int, int, int]]:
    """(id, version counter, storage address) of each parameter and buffer: what a frozen graph copied."""
    return [(id(t), _version(t), t.data_ptr()) for t in (*model.parameters(), *model.buffers())]


def _version(t: torch.Tensor) -> int:
    # Inference tensors (made under inference_mode) keep no version counter: they cannot be changed outside it.
    return 0 if t.is_inference() else t._version
