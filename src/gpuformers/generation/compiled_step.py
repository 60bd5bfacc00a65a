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

Mixture-of-experts blocks on the CPU: SparseMoeBlock's torch forward reads which experts got tokens on the host
(`.tolist()`), which a graph cannot hold. On the CPU, where nothing is captured, the compiled step runs each such
block as one opaque op (`gpuformers::module_outside_graph`: the block's own forward, called eagerly from inside
the graph, its output shaped like its input), so the rest of the layer stays in one graph and the wait happens
inside the op. `lifted_host_waits(liftable(model))` installs that forward on the block instances for the duration of a step
(as kernels/cpu_linear.py's copies are installed) and takes it away after, so eager forwards, training and the
engine never see it.

Offers: CompiledStep, CPU_INDUCTOR_SETTINGS, DYNAMO_SETTINGS, liftable, lifted_host_waits.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref

import torch
from torch import nn

from gpuformers.generation.compile_config import CompileConfig
from gpuformers.layers.moe import SparseMoeBlock, host_syncing_modules

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
        self.lifted = liftable(model)  # (MoE blocks, CPU only: run outside the graph, module docstring)

    def still_valid(self, model: nn.Module) -> bool:
        """Whether the compiled step still computes with the model's weights (always, without freezing). When not,
        the compiled code of the model's forward is dropped (module docstring): the caller builds a new step."""
        if self.weights is None or _weights_state(model) == self.weights:
            return True
        torch._dynamo.reset_code(self.code)
        return False

    def __call__(self, **inputs):
        with lifted_host_waits(self.lifted), torch._dynamo.config.patch(DYNAMO_SETTINGS):
            if not self.freezes:
                return self.function(**inputs)
            with torch._inductor.config.patch(CPU_INDUCTOR_SETTINGS):
                return self.function(**inputs)


# Each lifted module under a number the op finds it by (the graph keeps the number as a constant), and the forward
# installed on it, made once so that the instance's forward is the same object at every step (Dynamo guards on it).
_LIFTED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (they go with their model)
_KEYS = itertools.count()
_LIFTED_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def liftable(model: nn.Module) -> list[nn.Module]:
    """The modules a compiled step runs outside its graph: on the CPU, the host-waiting modules whose forward maps a
    hidden-state tensor to one of the same shape (SparseMoeBlock); elsewhere none."""
    if model.get_input_embeddings().weight.device.type != "cpu":
        return []
    names = set(host_syncing_modules(model))
    return [m for name, m in model.named_modules() if name in names and isinstance(m, SparseMoeBlock)]


@contextlib.contextmanager
def lifted_host_waits(modules: list[nn.Module]):
    """While the block runs, `modules` (liftable's) run through gpuformers::module_outside_graph."""
    for module in modules:
        forward = _LIFTED_FORWARD.get(module)
        if forward is None:
            key = next(_KEYS)
            _LIFTED[key] = module
            forward = _LIFTED_FORWARD[module] = functools.partial(_outside_graph, key=key)
        module.forward = forward
    try:
        yield
    finally:
        for module in modules:
            module.__dict__.pop("forward", None)


def _outside_graph(hidden_states: torch.Tensor, key: int) -> torch.Tensor:
    return torch.ops.gpuformers.module_outside_graph(hidden_states, key)


@torch.library.custom_op("gpuformers::module_outside_graph", mutates_args=())
def _module_outside_graph(hidden_states: torch.Tensor, key: int) -> torch.Tensor:
    """The lifted module's own forward, eagerly: (..., hidden) -> (..., hidden)."""
    module = _LIFTED[key]
    return type(module).forward(module, hidden_states).clone()


@_module_outside_graph.register_fake
def _(hidden_states, key):
    return torch.empty_like(hidden_states)


def key_of(options: CompileConfig) -> tuple:
    """What identifies a CompileConfig's compiled step."""
    return tuple(sorted(options.to_dict().items(), key=str))


def _weights_state(model: nn.Module) -> list[tuple[int, int, int]]:
    """(id, version counter, storage address) of each parameter and buffer: what a frozen graph copied."""
    return [(id(t), _version(t), t.data_ptr()) for t in (*model.parameters(), *model.buffers())]


def _version(t: torch.Tensor) -> int:
    # Inference tensors (made under inference_mode) keep no version counter: they cannot be changed outside it.
    return 0 if t.is_inference() else t._version
