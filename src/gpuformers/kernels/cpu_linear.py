"""Prepacked linear weights for CPU inference: each float32 nn.Linear's weight kept a second time in oneDNN's
blocked layout, used by the engine's steps and by generate() for the matmuls where it is faster than F.linear.

torch's nn.Linear on the CPU calls MKL's sgemm, which copies the weight into its own panel layout on every call;
a weight reordered once into oneDNN's layout (torch.ops.mkldnn._reorder_linear_weight, the op torch.compile's CPU
weight freezing uses) skips that copy, and oneDNN picks its kernels from the CPU's instruction set, where MKL
picks them from the vendor: on AMD CPUs with AVX-512 it runs its AVX2 code. Which one wins depends on the machine
and the row count, so it is measured, once per process and thread count, on 32 MB of weights at 1, 2, 4, 16, 64
and 256 rows; a row count takes the decision of the largest probe not above it, measured when first needed
(~25 ms a probe; `calibration()` measures them all).
Two of this project's 2-core machines, 1 thread, the 100M Qwen3-shaped stack with its LM head, ms per pass
(`python benchmarks/bench_cpu_linear.py`):

    rows                     1     2     4    16    64   256   512
    CPU A  MKL              31    33    61    85   143   310   677
           packed           34    37    39    58   121   301   753     -> packed for 4..192 rows
    CPU B  MKL (AMD EPYC)   20    32    31    51   136   458   948
    (AVX-512) packed        11    11    12    21    55   192   412     -> packed for every row count

`GPUFORMERS_CPU_PACKED_ROWS` overrides the measurement: "all", "none", or row ranges such as "4-192,300-".

The results differ from F.linear's by rounding only (another summation order), as MKL's own kernels do between
row counts. Sibling layers fed the same input (q/k/v, gate/up) share one packed weight, so one wider matmul
serves them. Calls that record a backward (training) always take F.linear.

The model is untouched outside a use: `PackedLinears.active()` sets the packed forward on each layer instance
while the block runs (one engine step, one generate() call) and takes it away after, so training and saving
never see it. A weight changed since it was packed (its version counter or storage moved: load_state_dict, an
optimizer step) is packed again when the next use begins. The cost is the linear weights' size again in memory:
the engine weighs it (engine/config.py) and generate() packs only while the copies take at most a quarter of
the available RAM (`packed_for`). One copy per model (`packed_linears`), kept with it for its next calls and
shared by generate() and an engine on it.

Offers: PackedLinears, cpu_matmuls, packed_linears, packed_for, release, packed_faster, packs_some_rows,
measure_up_to, calibration, prepack_available, packable_linears, available_ram, SIBLINGS.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import threading
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

_PACK_HINT_ROWS = 32  # the row count oneDNN is told to expect; the packed weight serves any count
_PROBES = (1, 2, 4, 16, 64, 256)  # row counts calibration() measures; each decides for the rows up to the next
ENV = "GPUFORMERS_CPU_PACKED_ROWS"
_MEASURING = threading.Lock()
_rule = [None, 1]  # (ENV's value, torch's thread count) as the latest PackedLinears.active() read them


def prepack_available() -> bool:
    """Whether this torch build has oneDNN and its linear-weight reorder op (x86 builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.cache
def _probe(rows: int, threads: int) -> tuple[float, float]:
    """(ms F.linear, ms packed) for `rows` rows over 32 MB of weights (more than most caches hold, as a step's
    weights are), best of three after a warm-up. `threads` only keys the cache: torch's current count is used."""
    weights = [torch.full((2048, 1024), 0.01) for _ in range(4)]
    x = torch.full((rows, 1024), 0.01)
    with torch.inference_mode():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS) for w in weights]

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times) * 1e3

        return (best(lambda: [F.linear(x, w) for w in weights]),
                best(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]))


def _measured(rows: int, threads: int) -> tuple[float, float]:
    """The probe at or below `rows` for `threads` threads, measured at its first use (a decode at batch 1 measures
    the 1-row probe and its prompt's, not the 256-row one: ~25 ms each instead of ~0.3 s for all)."""
    with _MEASURING:  # two threads starting at once would time each other
        return _probe(_PROBES[bisect.bisect_right(_PROBES, rows) - 1], threads)


def measure_up_to(rows: int) -> None:
    """Measure now the probes that row counts up to `rows` would need (an engine at start, so that its first steps
    do not pay for it)."""
    if prepack_available() and not os.environ.get(ENV):
        for probe in _PROBES[:bisect.bisect_right(_PROBES, max(rows, 1))]:
            _measured(probe, torch.get_num_threads())


def calibration() -> dict[int, tuple[float, float]]:
    """This machine's measurement at the current thread count: {rows: (ms F.linear, ms packed)} at each probe row
    count (see the module docstring); each probe is measured once, at its first use."""
    if not prepack_available():
        return {}
    return {rows: _measured(rows, torch.get_num_threads()) for rows in _PROBES}


def _parse_rows(text: str) -> list[tuple[int, float]]:
    """"all" | "none" | "a-b,c-,d" -> [(low, high)] inclusive ranges; a ValueError naming the variable if malformed."""
    text = text.strip().lower()
    if text in ("all", "none"):
        return [(1, float("inf"))] if text == "all" else []
    ranges = []
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            ranges.append((int(low), float(high) if high else float("inf")) if dash else (int(low), int(low)))
    except ValueError:
        raise ValueError(f"{ENV}={text!r} is not 'all', 'none' or row ranges such as '4-192,300-'") from None
    return ranges


def packed_faster(rows: int) -> bool:
    """Whether a matmul of `rows` rows takes the packed weight: GPUFORMERS_CPU_PACKED_ROWS if set, else this
    machine's calibration (the probe at or below `rows`)."""
    return _decide(rows, os.environ.get(ENV), torch.get_num_threads())


@functools.lru_cache(maxsize=4096)  # asked once per linear call: a dict look-up after the first time
def _decide(rows: int, override: str | None, threads: int) -> bool:
    if rows < 1:
        return False
    if override:
        return any(low <= rows <= high for low, high in _parse_rows(override))
    if not prepack_available():
        return False
    plain, packed = _measured(rows, threads)
    return packed < plain


def packs_some_rows() -> bool:
    """Whether packed weights would serve any row count here: packed_faster at some probe (measured in order, so
    a machine where they win at one row measures that probe alone), or at a large count."""
    return any(packed_faster(rows) for rows in (*_PROBES, 1 << 20))


def packable_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's plain float32 nn.Linear layers on the CPU with plain weights (quantized and LoRA layers are other
    classes, but the base layer inside a LoRA wrapper is a plain one and counts; tensor-parallel weights are
    DTensors and do not)."""
    return [m for m in model.modules()
            if type(m) is nn.Linear and type(m.weight) in (nn.Parameter, torch.Tensor)  # not a DTensor, say
            and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


def available_ram() -> int | None:
    """Bytes of RAM the OS says are available, or None where it cannot say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# Sibling layers that a decoder feeds the same input, one after the other: one packed weight serves each group
# (one matmul of the summed width instead of three or two narrower ones, 4-8% of a step's matmul time).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _PackedGroup:
    """One packed weight (and bias) for one layer, or for sibling layers stacked along their outputs. The first of
    them called with an input runs the matmul for all; each gets its own columns (a view) of that output. The last
    input and its outputs are kept per thread: two threads may run the same model at once."""

    __slots__ = ("layers", "widths", "packed", "bias", "versions", "_last", "matmul")

    def __init__(self, layers: list[nn.Linear]):
        self.matmul = torch.ops.mkldnn._linear_pointwise.default  # the overload itself: no look-up per call
        self.layers = layers
        self.widths = [layer.out_features for layer in layers]
        self._last = threading.local()
        self.repack()

    @torch.inference_mode()  # the copies are constants: no autograd record of the concatenation
    def repack(self) -> None:
        weights = [layer.weight for layer in self.layers]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            torch.cat(weights) if len(weights) > 1 else weights[0], _PACK_HINT_ROWS)
        biases = [layer.bias for layer in self.layers]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else layer.weight.new_zeros(layer.out_features)
             for b, layer in zip(biases, self.layers)])
        self.versions = self._versions()

    def _versions(self) -> list[tuple[torch.Tensor, int, int]]:
        """What identifies the weights and biases packed: each tensor, its version counter and its storage."""
        return [(t, _version(t), t.data_ptr()) for layer in self.layers for t in (layer.weight, layer.bias)
                if t is not None]

    def refresh(self) -> None:
        """Pack again if a weight or bias changed since (load_state_dict, an optimizer step, a new tensor)."""
        current = self._versions()
        if len(current) != len(self.versions) or any(
                now[0] is not then[0] or now[1:] != then[1:] for now, then in zip(current, self.versions)):
            self.repack()

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling `index`'s output for x: its columns of the group's matmul, run by the first sibling called."""
        last = self._last
        if getattr(last, "input", None) is x and _version(x) == last.version and not torch.is_grad_enabled():
            out = last.outputs[index]  # a sibling ran the matmul for this input
        else:
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            if x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled() or not _decide(rows, *_rule):
                # (an input off the CPU: a layer offloaded to the CPU runs on a GPU, its weights copied in there)
                layer = self.layers[index]
                return F.linear(x, layer.weight, layer.bias)
            # (..., in) -> (..., sum of widths): oneDNN takes any leading dimensions, so no reshape around it
            full = self.matmul(x if x.is_contiguous() else x.contiguous(), self.packed, self.bias, "none", [], "")
            last.input, last.version = x, _version(x)
            last.outputs = full.split_with_sizes(self.widths, -1)
            out = last.outputs[index]
        return out  # (..., out_features)

    def forward_one(self, x: torch.Tensor) -> torch.Tensor:
        """The forward of a group of one layer: nothing to share, so nothing kept."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled() or not _decide(rows, *_rule):
            layer = self.layers[0]
            return F.linear(x, layer.weight, layer.bias)
        return self.matmul(x if x.is_contiguous() else x.contiguous(), self.packed, self.bias, "none", [], "")

    def forget_input(self) -> None:
        self._last.input = self._last.outputs = None


def _version(t: torch.Tensor) -> int:
    """How many times t was changed in place; 0 for a tensor made in inference mode, which does not count (the
    steps' activations are such, and they are not changed between two sibling calls)."""
    return 0 if t.is_inference() else t._version


def _groups(model: nn.Module) -> list[list[nn.Linear]]:
    """The packable layers, siblings (SIBLINGS, of the same input width) together, every other layer alone."""
    packable = {id(layer): layer for layer in packable_linears(model)}
    groups = []
    for module in model.modules():
        for names in SIBLINGS:
            layers = [module._modules.get(name) for name in names]
            if all(layer is not None and id(layer) in packable for layer in layers) \
                    and len({layer.in_features for layer in layers}) == 1:
                groups.append(layers)
                for layer in layers:
                    del packable[id(layer)]
    return groups + [[layer] for layer in packable.values()]


class PackedLinears:
    """Packed copies of a model's plain float32 linear weights, and the switch that makes a block of work use them."""

    _lock = threading.Lock()

    def __init__(self, model: nn.Module):
        self.groups = [_PackedGroup(layers) for layers in _groups(model)]
        self._users = 0  # active() blocks running now, in any thread
        self._installed: list[nn.Linear] = []

    @property
    def layers(self) -> list[nn.Linear]:
        return [layer for group in self.groups for layer in group.layers]

    @property
    def nbytes(self) -> int:
        """Memory the packed copies take (about the linear weights' own size)."""
        return sum(g.packed.numel() * g.packed.element_size() for g in self.groups)

    @contextlib.contextmanager
    def active(self):
        """Route the model's linear layers through their packed weights until the block ends. Blocks may nest or
        overlap across threads: the forwards are set by the first to enter and taken away by the last to leave."""
        with self._lock:
            _rule[:] = os.environ.get(ENV), torch.get_num_threads()  # read once per use, not per matmul
            if self._users == 0:
                for group in self.groups:
                    group.refresh()  # weights are checked once per use, not per call
                    for index, layer in enumerate(group.layers):
                        if "forward" not in layer.__dict__:  # another wrapper's instance forward stays as it is
                            layer.forward = functools.partial(group.forward, index) if len(group.layers) > 1 \
                                else group.forward_one
                            self._installed.append(layer)
            self._users += 1
        try:
            yield
        finally:
            for group in self.groups:
                group.forget_input()  # this thread's activations are not kept alive
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for layer in self._installed:
                        layer.__dict__.pop("forward", None)
                    self._installed = []


_FOR_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def packed_linears(model: nn.Module, linears: list[nn.Linear] | None = None) -> PackedLinears:
    """The model's PackedLinears, made at the first call and kept with the model (a weak reference: they go with it)
    while its packable layers (`linears`, found when not given) stay the same ones, so that generate() and an engine
    on one model share one copy."""
    linears = packable_linears(model) if linears is None else linears
    kept = _kept_for(model, linears)
    if kept is None:
        kept = _FOR_MODEL[model] = PackedLinears(model)
    return kept


def _kept_for(model: nn.Module, linears: list[nn.Linear]) -> PackedLinears | None:
    """The copies kept for `model` if they are of these layers."""
    kept = _FOR_MODEL.get(model)
    if kept is None or {id(layer) for layer in kept.layers} != {id(layer) for layer in linears}:
        return None
    return kept


def release(model: nn.Module) -> None:
    """Let go of the copies kept for `model`, if any."""
    _FOR_MODEL.pop(model, None)


def packed_for(model: nn.Module) -> PackedLinears | None:
    """The packed copies generate() uses for `model` (packed_linears), or None when they would not pay or not fit:
    no oneDNN, no float32 linear layer on the CPU, no row count where calibration() found them faster, or copies
    that would take more than a quarter of the available RAM (unless they are made already)."""
    linears = packable_linears(model) if prepack_available() else []
    if not linears or not packs_some_rows():
        release(model)  # moved to a GPU or to bfloat16, say: the old copies are dead weight
        return None
    if _kept_for(model, linears) is None:
        copies = sum(layer.weight.numel() * layer.weight.element_size() for layer in linears)
        ram = available_ram()
        if ram is not None and copies > ram // 4:
            return None
    return packed_linears(model, linears)


def cpu_matmuls(model: nn.Module):
    """The block a model's inference forwards run in (generate(), an assistant model, the embedding server): its
    packed_for copies active while the model is on the CPU; on a GPU (its layers offloaded to the CPU run there
    too, their weights copied in) nothing, and copies made while it was on the CPU go."""
    if model.get_input_embeddings().weight.device.type != "cpu":
        release(model)
        return contextlib.nullcontext()
    packed = packed_for(model)  # None without float32 linear layers, and copies made before go
    return packed.active() if packed is not None else contextlib.nullcontext()
