"""use_kernels=True: which layers a Triton kernel may replace, KernelConfig to choose per layer, and kernelize.

Layers declare what they are with a class attribute `kernel_layer_name` ("RMSNorm", "SwiGLUMLP", "SparseMoeBlock";
torch's nn.SiLU counts as "SiLU"); functions do it with the `use_kernel_function(name)` decorator ("rotary_pos_emb",
"ForCausalLMLoss"). `kernelize(model, mode=...)` then

    module layer   -> its forward is replaced on that instance (the class is untouched, the weights keep their
                      values; the MoE kernel moves a block's expert weights into one buffer, kernels/moe.py)
    function layer -> while the model's forward runs, calls to the function go to the kernel (a ContextVar set by
                      forward hooks on the model, so two models in one process keep their own choice; torch.compile
                      cannot read a ContextVar, so compiled code reads the same choice from a stack the hooks push)

Modes: Mode.INFERENCE (no autograd bookkeeping; rotary runs in place; the MoE block's grouped-GEMM experts and the
Mamba2 mixer's conv, scan and state step, and their in-place forms on the engine's state slots), Mode.TRAINING
(kernels with a backward, the Mamba2 conv and scan included; the MoE block and the Mamba2 decode step keep torch),
Mode.TORCH_COMPILE (added to either, for a model that will run under torch.compile; it installs the same kernels).
Every kernel is also a torch.library op (ops.py, namespace `gpuformers`; the MoE one in moe.py) and the kernel
functions call their op while torch.compile traces them, so a compiled model keeps the kernels in its graph with no
graph break, fullgraph=True included; rotary is then out of place. The MoE block is the exception: it finds its
stacked expert weights outside the graph (one break per block; its torch forward breaks the graph too).
`model.train()` / `model.eval()` call kernelize again for the new mode.

Kernels run on NVIDIA GPUs, and on the CPU only under TRITON_INTERPRET=1 (tests); elsewhere the torch layers are
kept and a warning says so once. GPUFORMERS_DISABLE_KERNELS=1 turns every kernel off. A KernelConfig may also name a
Hub or local kernel for a module layer ("org/repo:Layer", kernels/hub_kernels.py): its class's forward replaces the
layer's the same way, on any device the kernel supports (no Triton needed), per device and per mode.

Offers: Mode, KernelConfig, HubLayerKernel, kernelize, rekernelize, unkernelize, kernels_available,
use_kernel_function, LayerKernel, register_layer_kernel, layer_names, active_kernel_functions, DISABLE_ENV,
warn_once (a warning logged once per message).
"""

from __future__ import annotations

import contextvars
import enum
import functools
import logging
import os
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from gpuformers.kernels.checks import triton_runs_on

logger = logging.getLogger(__name__)

DISABLE_ENV = "GPUFORMERS_DISABLE_KERNELS"
DEVICES = ("cuda", "cpu")  # "cpu" entries apply under TRITON_INTERPRET=1; without one, the "cuda" entry is used
TORCH = "torch"  # the kernel name that keeps a layer's torch forward

_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


class Mode(enum.Flag):
    INFERENCE = enum.auto()
    TRAINING = enum.auto()
    TORCH_COMPILE = enum.auto()


@dataclass(frozen=True)
class LayerKernel:
    """One kernel for one layer name: `inference` and `training` are forwards (module methods, or plain functions
    for function layers) imported lazily from "module:attribute" paths so that triton loads only when used."""

    layer_name: str
    kernel_name: str
    inference: str
    training: str
    is_function: bool = False
    is_hub = False  # (not a field) a built-in kernel, unlike HubLayerKernel

    def forward_for(self, mode: Mode) -> Callable:
        import importlib

        path = self.training if Mode.TRAINING in mode else self.inference
        module, _, attribute = path.partition(":")
        return getattr(importlib.import_module(module), attribute)


_REGISTRY: dict[str, dict[str, LayerKernel]] = {}
# torch classes that count as a kernel layer without a kernel_layer_name attribute
_TORCH_CLASSES: dict[type, str] = {nn.SiLU: "SiLU"}


def register_layer_kernel(kernel: LayerKernel) -> None:
    _REGISTRY.setdefault(kernel.layer_name, {})[kernel.kernel_name] = kernel


def layer_names() -> list[str]:
    return sorted(_REGISTRY)


_ADAPTERS = "gpuformers.kernels.mapping"
for _kernel in (
    LayerKernel("RMSNorm", "triton", f"{_ADAPTERS}:_rms_norm_forward", f"{_ADAPTERS}:_rms_norm_forward"),
    LayerKernel("SwiGLUMLP", "triton", f"{_ADAPTERS}:_swiglu_mlp_forward", f"{_ADAPTERS}:_swiglu_mlp_forward"),
    LayerKernel("SiLU", "triton", f"{_ADAPTERS}:_silu_forward", f"{_ADAPTERS}:_silu_forward"),
    # Inference only: the grouped-GEMM MoE kernel has no backward, so training keeps the torch block.
    LayerKernel("SparseMoeBlock", "triton", "gpuformers.kernels.moe:sparse_moe_forward",
                f"{_ADAPTERS}:_torch_forward"),
    LayerKernel("rotary_pos_emb", "triton", "gpuformers.kernels.rotary:apply_rotary_inplace",
                "gpuformers.kernels.rotary:apply_rotary", is_function=True),
    LayerKernel("ForCausalLMLoss", "triton", "gpuformers.kernels.fused_linear_cross_entropy:causal_lm_loss_triton",
                "gpuformers.kernels.fused_linear_cross_entropy:causal_lm_loss_triton", is_function=True),
    LayerKernel("AddRMSNorm", "triton", f"{_ADAPTERS}:_add_rms_norm", f"{_ADAPTERS}:_add_rms_norm", is_function=True),
    # The Mamba2 mixer's parts (layers/mamba2.py, layers/ssd.py). The conv and the scan have a Triton backward,
    # used in training; at inference a call that needs gradients falls back to the torch functions. The decode step
    # has no backward (decode only): training keeps the torch step.
    LayerKernel("causal_conv1d", "triton", "gpuformers.kernels.causal_conv1d:causal_conv1d_triton",
                "gpuformers.kernels.causal_conv1d:causal_conv1d_train", is_function=True),
    LayerKernel("ssd_chunk_scan", "triton", "gpuformers.kernels.ssd:ssd_chunk_scan_triton",
                "gpuformers.kernels.ssd_backward:ssd_chunk_scan_train", is_function=True),
    LayerKernel("ssm_state_step", "triton", "gpuformers.kernels.ssd:ssm_state_step_triton",
                f"{_ADAPTERS}:_torch_function", is_function=True),
    # The engine's decode batch (engine/state_slots.py): the conv update and the state step on rows of the state
    # slots' pool, in place. Decode only, like the step.
    LayerKernel("causal_conv1d_indexed", "triton", "gpuformers.kernels.causal_conv1d:causal_conv1d_indexed_triton",
                f"{_ADAPTERS}:_torch_function", is_function=True),
    LayerKernel("ssm_state_step_indexed", "triton", "gpuformers.kernels.ssd:ssm_state_step_indexed_triton",
                f"{_ADAPTERS}:_torch_function", is_function=True),
    # Training only: the model takes this path in train() mode alone, so evaluation still returns logits.
    LayerKernel("LinearForCausalLMLoss", "triton", "gpuformers.layers.loss:linear_causal_lm_loss",
                "gpuformers.kernels.fused_linear_cross_entropy:linear_causal_lm_loss_triton", is_function=True),
):
    register_layer_kernel(_kernel)


# --- forwards that replace module layers (self is the layer) ------------------------------------------------

def _rms_norm_forward(self, hidden_states):
    from gpuformers.kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _add_rms_norm(hidden_states, residual, norm):
    from gpuformers.kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, norm.weight, norm.variance_epsilon, residual=residual)


def _swiglu_mlp_forward(self, x):
    from gpuformers.kernels.swiglu import silu_and_mul

    return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _silu_forward(self, x):
    from gpuformers.kernels.swiglu import silu

    return silu(x)


def _torch_forward(self, *args, **kwargs):
    # A mode without a kernel for this layer: the class's own forward.
    return type(self).forward(self, *args, **kwargs)


def _torch_function(*args, **kwargs):
    # A function layer's mode without a kernel: NotImplemented sends the call to the torch function.
    return NotImplemented


# --- function layers ----------------------------------------------------------------------------------------

_ACTIVE_FUNCTIONS: contextvars.ContextVar[dict[str, Callable]] = contextvars.ContextVar("gpuformers_kernel_functions",
                                                                                         default={})
# How many kernelized forwards are running, in any thread. While it is 0 a marked function calls torch directly
# without reading the ContextVar, which torch.compile cannot trace (a graph break in every layer otherwise).
_ACTIVE_DEPTH = 0
# The same choices as a plain stack (one dict per running kernelized forward, innermost last), which torch.compile
# can read and push to. Process-wide, so compiled code in two threads running differently kernelized models at
# the same moment could see the other's choice; eager code reads the per-thread ContextVar.
_COMPILED_STACK: list[dict[str, Callable]] = []


def _functions_in_force() -> dict[str, Callable]:
    if torch.compiler.is_compiling():
        return _COMPILED_STACK[-1] if _COMPILED_STACK else {}
    return _ACTIVE_FUNCTIONS.get()


def use_kernel_function(layer_name: str):
    """Mark a torch function as a kernel layer: inside a kernelized model's forward, calls go to the kernel. A
    kernel that cannot serve a call (inputs it does not cover) returns NotImplemented, and the torch function runs."""

    def decorate(fn):
        @functools.wraps(fn)
        def dispatch(*args, **kwargs):
            if not _ACTIVE_DEPTH:
                return fn(*args, **kwargs)
            kernel = _functions_in_force().get(layer_name)
            out = NotImplemented if kernel is None else kernel(*args, **kwargs)
            return fn(*args, **kwargs) if out is NotImplemented else out

        dispatch.kernel_layer_name = layer_name
        dispatch.torch_function = fn
        return dispatch

    return decorate


# --- configuration ------------------------------------------------------------------------------------------

@dataclass
class HubLayerKernel:
    """A module layer's forward from a Hub repo or a local folder (kernels/hub_kernels.py), loaded when applied."""

    spec: object  # hub_kernels.HubKernelSpec
    is_function: bool = False
    is_hub: bool = True

    def forward_for(self, mode: Mode, layer_class: type | None = None) -> Callable:
        from gpuformers.kernels.hub_kernels import kernel_layer_forward

        return kernel_layer_forward(self.spec, layer_class or nn.Module)


# Device keys transformers accepts in a kernel_mapping; those other than DEVICES are accepted and never apply here.
OTHER_DEVICES = ("rocm", "xpu", "npu", "neuron", "tpu", "mps")
MODES = ("inference", "training")


def _mode_key(key) -> str:
    """"inference" / "training" from a string or a Mode (ours or the kernels package's, TORCH_COMPILE ignored)."""
    name = key.lower() if isinstance(key, str) else str(getattr(key, "name", "") or key).lower()
    for mode in MODES:
        if mode in name:
            return mode
    raise ValueError(f"kernel mapping mode {key!r} is not one of: {', '.join(MODES)} (or Mode.INFERENCE / "
                     f"Mode.TRAINING)")


@dataclass
class KernelConfig:
    """Which kernel each layer uses, per device and mode, with transformers' spellings:

        {"RMSNorm": "triton", "SwiGLUMLP": "torch"}                      our Triton kernel / the torch forward
        {"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm"}      a Hub kernel (the `kernels` package)
        {"RMSNorm": ("org/repo:Layer", {"version": 1, "trust_remote_code": True})}
        {"RMSNorm": {"cuda": "...", "rocm": "...", "cpu": "..."}}        per device
        {"RMSNorm": {"cuda": {"inference": "...", "training": "..."}}}   per mode (also Mode.INFERENCE keys)
        KernelConfig({"RMSNorm": "/path/to/kernel:Layer"}, use_local_kernel=True)   a local kernel folder

    A plain value applies to every device and both modes; a per-mode dict leaves the modes it does not name on
    the torch forward. Layers not named keep the default (our Triton kernel). On the CPU without a "cpu" entry
    the "cuda" one applies. Device keys rocm/xpu/npu/neuron/tpu/mps are accepted and never apply (NVIDIA and CPU
    only). Hub and local kernels replace module layers only, and are checked and loaded when applied.
    """

    kernel_mapping: dict = field(default_factory=dict)
    use_local_kernel: bool = False

    def __post_init__(self):
        if not isinstance(self.kernel_mapping, dict):
            raise TypeError(
                f"kernel_mapping must be a dict of layer name -> kernel, got {type(self.kernel_mapping).__name__}"
            )
        self.kernel_mapping = {layer: self._per_device(layer, choice) for layer, choice in self.kernel_mapping.items()}

    def _per_device(self, layer: str, choice) -> dict:
        if isinstance(choice, dict) and choice and all(k in DEVICES + OTHER_DEVICES for k in choice):
            per_device = dict(choice)
        elif isinstance(choice, dict) and choice and all(_is_mode(k) for k in choice):
            per_device = {device: choice for device in DEVICES}
        elif isinstance(choice, (str, tuple)):
            per_device = {device: choice for device in DEVICES}
        elif isinstance(choice, dict):
            bad = [k for k in choice if k not in DEVICES + OTHER_DEVICES and not _is_mode(k)]
            raise ValueError(f"kernel_mapping[{layer!r}] names device {bad[0]!r}, which is not one of: "
                             f"{', '.join(DEVICES + OTHER_DEVICES)} (or a mode: {', '.join(MODES)})")
        else:
            raise TypeError(f"kernel_mapping[{layer!r}] must be a kernel name, 'org/repo:Layer', or a dict of "
                            f"device -> kernel")
        return {device: self._per_mode(layer, device, value) for device, value in per_device.items()}

    def _per_mode(self, layer: str, device: str, value) -> dict:
        if isinstance(value, dict):
            return {_mode_key(mode): self._kernel(layer, device, kernel) for mode, kernel in value.items()}
        kernel = self._kernel(layer, device, value)
        return {mode: kernel for mode in MODES}

    def _kernel(self, layer: str, device: str, kernel):
        from gpuformers.kernels.hub_kernels import looks_like_hub_kernel, parse_kernel

        built_in = isinstance(kernel, str) and (kernel == TORCH or kernel in _REGISTRY.get(layer, {}))
        if looks_like_hub_kernel(kernel) or (self.use_local_kernel and not built_in):
            if layer in _REGISTRY and all(k.is_function for k in _REGISTRY[layer].values()):
                raise NotImplementedError(f"kernel_mapping[{layer!r}]: {layer} is a function layer; Hub and local "
                                          f"kernels replace module layers only (use 'triton' or 'torch')")
            return HubLayerKernel(parse_kernel(kernel, local=self.use_local_kernel))
        if layer not in _REGISTRY:
            raise ValueError(
                f"kernel_mapping names layer {layer!r}, which has no built-in kernel (those that have: "
                f"{', '.join(layer_names())}); name a Hub kernel 'org/repo:Layer' for it instead"
            )
        valid = sorted(_REGISTRY[layer]) + [TORCH]
        if kernel not in valid:
            raise ValueError(
                f"kernel_mapping[{layer!r}][{device!r}] is {kernel!r}, which is not one of: {', '.join(valid)} "
                f"(or a Hub kernel 'org/repo:Layer')"
            )
        return kernel

    def kernel_for(self, layer: str, device_type: str, mode: Mode = Mode.INFERENCE):
        """The kernel `layer` uses on `device_type` in `mode` (a LayerKernel or HubLayerKernel), or None to keep the
        torch layer."""
        per_device = self.kernel_mapping.get(layer, {})
        per_mode = per_device.get(device_type, per_device.get("cuda"))  # the CPU takes the "cuda" entry
        # a device not named keeps the default; a mode not named in a per-mode dict keeps the torch forward
        choice = "triton" if per_mode is None else per_mode.get("training" if Mode.TRAINING in mode else "inference",
                                                                TORCH)
        if isinstance(choice, HubLayerKernel):
            return choice
        return None if choice == TORCH else _REGISTRY.get(layer, {}).get(choice)

    def hub_layers(self) -> set[str]:
        """The layer names that some device or mode maps to a Hub or local kernel."""
        return {layer for layer, per_device in self.kernel_mapping.items()
                if any(isinstance(k, HubLayerKernel) for per_mode in per_device.values() for k in per_mode.values())}


def _is_mode(key) -> bool:
    try:
        _mode_key(key)
    except ValueError:
        return False
    return True


@dataclass
class _KernelState:
    """What a kernelized model remembers so that train() / eval() can re-apply its kernels."""

    config: KernelConfig
    compile: bool
    device: torch.device | None
    mode: Mode
    functions: dict = field(default_factory=dict)
    hooks: list = field(default_factory=list)
    tokens: list = field(default_factory=list)

    def mode_for(self, training: bool) -> Mode:
        mode = Mode.TRAINING if training else Mode.INFERENCE
        return mode | Mode.TORCH_COMPILE if self.compile else mode


# --- kernelize ----------------------------------------------------------------------------------------------

def kernels_available(device: torch.device | str) -> tuple[bool, str]:
    """(True, "") when kernels can run on `device`, else (False, why) in words."""
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return False, f"{DISABLE_ENV} is set"
    return triton_runs_on(device)


def _layer_name(module: nn.Module) -> str | None:
    return getattr(module, "kernel_layer_name", None) or _TORCH_CLASSES.get(type(module))


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def kernelize(model: nn.Module, mode: Mode = Mode.INFERENCE, kernel_config: KernelConfig | None = None,
              device: torch.device | str | None = None) -> nn.Module:
    """Swap the forwards of the model's kernel layers for Triton kernels chosen for `mode`; returns the model."""
    if not isinstance(mode, Mode):
        raise TypeError(f"mode must be a kernels Mode (Mode.INFERENCE, Mode.TRAINING, ...), got {mode!r}")
    if (Mode.INFERENCE in mode) == (Mode.TRAINING in mode):
        raise ValueError(f"mode {mode} must contain exactly one of Mode.INFERENCE and Mode.TRAINING")
    if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
        raise TypeError(f"kernel_config must be a KernelConfig, got {type(kernel_config).__name__}")
    state = getattr(model, "_kernel_state", None)
    if state is None:
        state = _KernelState(kernel_config or KernelConfig(), Mode.TORCH_COMPILE in mode, device, mode)
        object.__setattr__(model, "_kernel_state", state)  # not a submodule or buffer
        # The function kernels are routed while the model's forward runs, and while its decoder stack's does: the
        # engine calls the stack (model.model) directly, without the LM head (the hooks nest)
        stack = getattr(model, "model", None)
        hooked = [model, stack] if isinstance(stack, nn.Module) and stack is not model else [model]
        state.hooks = [hook for module in hooked for hook in (
            module.register_forward_pre_hook(_enter_functions(state)),
            module.register_forward_hook(_exit_functions(state), always_call=True))]
    else:
        state.config = kernel_config or state.config
        state.compile, state.mode = Mode.TORCH_COMPILE in mode, mode
        state.device = torch.device(device) if device is not None else state.device
    _restore_torch_forwards(model, state)

    target = torch.device(state.device) if state.device is not None else _model_device(model)
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        warn_once(f"use_kernels=True keeps the torch layers: {DISABLE_ENV} is set")
        return model
    triton_ok, why = kernels_available(target)
    found: set[str] = set()
    for module in model.modules():
        layer = _layer_name(module)
        if layer is None:
            continue
        found.add(layer)
        kernel = state.config.kernel_for(layer, target.type, mode)
        if kernel is None or kernel.is_function or not (triton_ok or getattr(kernel, "is_hub", False)):
            continue
        forward = (kernel.forward_for(mode, type(module)) if getattr(kernel, "is_hub", False)
                   else kernel.forward_for(mode))
        module.forward = types.MethodType(forward, module)
        module._kernel_mode = mode
    missing = state.config.hub_layers() - found
    if missing:
        raise ValueError(f"kernel_config maps {', '.join(sorted(missing))} to a Hub kernel, but this model has no such "
                         f"layer; its kernel layers are: {', '.join(sorted(found)) or 'none'}")
    if not triton_ok:
        warn_once(f"use_kernels=True keeps the torch layers for the Triton kernels: {why}")
        return model
    for layer in _REGISTRY:  # function layers: routed while this model's forward runs (see _enter_functions)
        kernel = state.config.kernel_for(layer, target.type, mode)
        if kernel is not None and kernel.is_function:
            state.functions[layer] = kernel.forward_for(mode)
    return model


def unkernelize(model: nn.Module) -> nn.Module:
    """Give every layer back its torch forward and forget the kernel choice (train()/eval() stop re-applying)."""
    state = getattr(model, "_kernel_state", None)
    if state is not None:
        _restore_torch_forwards(model, state)
        for handle in state.hooks:
            handle.remove()
        object.__delattr__(model, "_kernel_state")
    return model


def _restore_torch_forwards(model: nn.Module, state: _KernelState) -> None:
    for module in model.modules():
        if "forward" in module.__dict__ and hasattr(module, "_kernel_mode"):
            del module.forward  # the class's torch forward shows through again
            del module._kernel_mode
    state.functions.clear()


def _enter_functions(state: _KernelState):
    def hook(module, args):
        global _ACTIVE_DEPTH
        _ACTIVE_DEPTH += 1
        _COMPILED_STACK.append(state.functions)
        # While torch.compile traces this hook (the whole model compiled) only the stack is used; the ContextVar,
        # which it cannot trace, is set in eager forwards.
        state.tokens.append(None if torch.compiler.is_compiling() else _ACTIVE_FUNCTIONS.set(dict(state.functions)))

    return hook


def _exit_functions(state: _KernelState):
    def hook(module, args, output):
        global _ACTIVE_DEPTH
        if state.tokens:
            token = state.tokens.pop()
            if token is not None:
                _ACTIVE_FUNCTIONS.reset(token)
            _COMPILED_STACK.pop()
            _ACTIVE_DEPTH -= 1

    return hook


def active_kernel_functions() -> dict[str, Callable]:
    """The function kernels in force right now (inside a kernelized model's forward; the model's forward reads it
    to choose the fused loss, so it also works while torch.compile traces)."""
    return dict(_functions_in_force())


def rekernelize(model: nn.Module) -> nn.Module:
    """Re-apply a kernelized model's kernels for its current train/eval mode (called by model.train())."""
    state = getattr(model, "_kernel_state", None)
    if state is None:
        return model
    return kernelize(model, mode=state.mode_for(model.training), kernel_config=state.config)
