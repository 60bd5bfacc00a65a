"""Copies of a model's float32 linear weights for CPU inference, each kept in the form this CPU multiplies fastest
(kernels/cpu_matmul_probe.py measures which), used by the engine's steps, generate() and the embedding server.

A group is one layer, or sibling layers fed the same input (q/k/v, gate/up) stacked along their outputs, so that
one wider matmul serves them (4-8% of a step's matmul time). Its copy takes one form, chosen for the row count
the use expects:
- an engine, an embedding server, generate() at several rows per step: PACKED (oneDNN's layout) wherever it
  wins at some row count; a call takes it at the row counts where it wins (packed_faster), else F.linear. Its
  input is padded to one of a few row counts (row_bucket: at most 25% more rows), since oneDNN keeps state per
  row count it meets, which grew a server by ~1 MB per count without end;
- generate() at one row per step (batch-1 decoding), unless GPUFORMERS_CPU_PACKED_ROWS is set: the fastest of
  the three forms for the group's shape at one row (one_row_times) where it saves at least _ONE_ROW_MIN_GAIN (10%),
  the groups that save the largest share first, while the copies take at most _ONE_ROW_COPY_SHARE (half) of the
  linear weights; every other group is ROWS, which copies nothing: siblings move into one buffer whose row slices
  become their weights (the same values, shapes and contiguity), a lone layer keeps its weight. COLUMNS and ROWS
  serve a call at any row count (the prompt's too): where COLUMNS wins at one row it also beat ROWS at 2-256 rows
  on the machine measured (the table in cpu_matmul_probe.py), and a concatenated weight saves calls. A one-shot
  answer (`one_shot()`, what `gpuformers generate` runs in) makes no copy at all: the main job peaked at 1.5 GB
  with the copies (the weights twice) against 0.96 GB without.
Calls that record a backward (training), and inputs that are not float32 on the CPU, always take F.linear.

The model is untouched outside a use, but for the ROWS groups' shared buffers (the same values and shapes):
`PackedLinears.active()` sets the copies' forward on each layer instance while the block runs (one engine step,
one generate() call) and takes it away after, so training and saving never see it. A weight changed since it was
copied (its version counter or storage moved: load_state_dict, an optimizer step) is copied again when the next
use begins. The cost is up to the linear weights' size again in memory where PACKED serves: the engine weighs it
(engine/config.py) and generate() keeps copies only while they take at most a quarter of the available RAM
(`packed_for`). One set of copies per model (`packed_linears`), kept with it for its next calls and shared by
generate() and an engine on it while they want the same forms.

Offers: PackedLinears, cpu_matmuls, one_shot, packed_linears, packed_for, release, packable_linears, available_ram,
copies_fit, row_bucket, SIBLINGS.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.kernels.cpu_matmul_probe import (COLUMNS, ENV, PACK_HINT_ROWS, PACKED, ROWS, current_rule, decide,
                                                 one_row_times, packs_some_rows, prepack_available)

_rule = [None, 1]  # current_rule() as the latest PackedLinears.active() read it


def packable_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's plain float32 nn.Linear layers on the CPU with plain weights (quantized and LoRA layers are other
    classes, but the base layer inside a LoRA wrapper is a plain one and counts; tensor-parallel weights are
    DTensors and do not)."""
    return [m for m in model.modules() if _packable(m)]


def _packable(module: nn.Module | None) -> bool:
    return (type(module) is nn.Linear and type(module.weight) in (nn.Parameter, torch.Tensor)  # not a DTensor, say
            and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu")


def available_ram() -> int | None:
    """Bytes of RAM the OS says are available, or None where it cannot say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# Sibling layers that a decoder feeds the same input, one after the other: one copy serves each group.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _PackedGroup:
    """One copy of the weight (and bias) of one layer, or of sibling layers stacked along their outputs, in one
    form. The first of them called with an input runs the matmul for all; each gets its own columns (a view) of
    that output. The last input and its outputs are kept per thread: two threads may run the same model at once."""

    __slots__ = ("layers", "widths", "form", "copy", "weight", "bias", "versions", "_last", "matmul")
    # ROWS copies nothing: a lone layer keeps its weight, siblings move into one (sum of widths, in) buffer whose
    # row slices become their weights (the same values, shapes and contiguity; no second copy in memory)

    def __init__(self, layers: list[nn.Linear], form: str):
        self.matmul = torch.ops.mkldnn._linear_pointwise.default if form == PACKED else None  # no look-up per call
        self.layers, self.form = layers, form
        self.widths = [layer.out_features for layer in layers]
        self._last = threading.local()
        self.repack()

    def repack(self) -> None:
        if self.form == ROWS:
            self.copy = self._relay_rows()
        else:
            with torch.inference_mode():  # the copies are constants: no autograd record of the concatenation
                weights = [layer.weight for layer in self.layers]
                weight = torch.cat(weights) if len(weights) > 1 else weights[0]  # (sum of widths, in)
                if self.form == PACKED:
                    self.copy = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS)
                else:
                    self.copy = weight.t().contiguous()  # COLUMNS: (in, sum of widths)
        self.weight = self.copy.t() if self.form == COLUMNS else self.copy  # what F.linear takes
        biases = [layer.bias for layer in self.layers]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else layer.weight.new_zeros(layer.out_features)
             for b, layer in zip(biases, self.layers)])
        self.versions = self._versions()

    def _relay_rows(self) -> torch.Tensor:
        """The layers' weights as row slices of one (sum of widths, in) buffer, which is returned: the siblings'
        old storages go, so the concatenation costs no memory beyond one group while it is made. A lone layer,
        or siblings already so laid, stay as they are."""
        weights = [layer.weight for layer in self.layers]
        if len(weights) == 1:
            return weights[0]
        laid = getattr(self, "copy", None)  # this group's buffer from before, if the weights are still its slices
        if laid is not None and all(w.data_ptr() == r.data_ptr() and w.shape == r.shape and w.is_contiguous()
                                    for w, r in zip(weights, laid.split_with_sizes(self.widths))):
            return laid  # (edited in place since, say: the buffer has the new values)
        # (not an inference tensor, even inside generate()'s inference mode: the model may train after it)
        with torch.inference_mode(False), torch.no_grad():
            buffer = torch.cat([w.detach() for w in weights])  # (sum of widths, in)
            for layer, rows in zip(self.layers, buffer.split_with_sizes(self.widths)):
                layer.weight.data = rows
        return buffer

    @property
    def nbytes(self) -> int:
        """Memory the group keeps beyond the layers' own weights: none for ROWS (module docstring)."""
        return 0 if self.form == ROWS else self.copy.numel() * self.copy.element_size()

    def _versions(self) -> list[tuple[torch.Tensor, int, int]]:
        """What identifies the weights and biases copied: each tensor, its version counter and its storage."""
        return [(t, _version(t), t.data_ptr()) for layer in self.layers for t in (layer.weight, layer.bias)
                if t is not None]

    def refresh(self) -> None:
        """Copy again if a weight or bias changed since (load_state_dict, an optimizer step, a new tensor)."""
        current = self._versions()
        if len(current) != len(self.versions) or any(
                now[0] is not then[0] or now[1:] != then[1:] for now, then in zip(current, self.versions)):
            self.repack()

    def _serves(self, x: torch.Tensor) -> bool:
        """Whether the copy computes this call: float32 on the CPU, no backward to record, and for a PACKED copy
        a row count where it wins."""
        if x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled():
            # (an input off the CPU: a layer offloaded to the CPU runs on a GPU, its weights copied in there)
            return False
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return decide(rows, *_rule) if self.form == PACKED else rows > 0

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., sum of widths) through the copy."""
        if self.matmul is None:
            return F.linear(x, self.weight, self.bias)
        x = x if x.is_contiguous() else x.contiguous()
        rows = x.numel() // x.shape[-1]
        bucket = row_bucket(rows)
        if bucket == rows:  # oneDNN takes any leading dimensions, so no reshape around it
            return self.matmul(x, self.copy, self.bias, "none", [], "")
        padded = x.new_empty(bucket, x.shape[-1])  # (bucket, in): the rows, then zeros
        padded[:rows] = x.view(rows, -1)
        padded[rows:].zero_()
        out = self.matmul(padded, self.copy, self.bias, "none", [], "")[:rows]  # (rows, sum of widths)
        return out.view(*x.shape[:-1], out.shape[-1])

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling `index`'s output for x: its columns of the group's matmul, run by the first sibling called."""
        last = self._last
        if getattr(last, "input", None) is x and _version(x) == last.version and not torch.is_grad_enabled():
            out = last.outputs[index]  # a sibling ran the matmul for this input
        else:
            if not self._serves(x):
                layer = self.layers[index]
                return F.linear(x, layer.weight, layer.bias)
            full = self._run(x)
            last.input, last.version = x, _version(x)
            last.outputs = full.split_with_sizes(self.widths, -1)
            out = last.outputs[index]
        return out  # (..., out_features)

    def forward_one(self, x: torch.Tensor) -> torch.Tensor:
        """The forward of a group of one layer: nothing to share, so nothing kept."""
        if not self._serves(x):
            layer = self.layers[0]
            return F.linear(x, layer.weight, layer.bias)
        return self._run(x)

    def forget_input(self) -> None:
        self._last.input = self._last.outputs = None


def row_bucket(rows: int) -> int:
    """The row count a PACKED matmul of `rows` rows runs at, its input padded with zero rows: up to 8 as they are,
    above that rounded up to a multiple of a quarter of the power of two below (10, 12, 14, 16, 20, 24, 28, 32, 40,
    ...): at most 25% more rows, 4 counts per doubling (32 up to 512 rows). oneDNN builds and keeps a primitive,
    with its own buffers, per row count it meets, which a server meets by the hundred: its memory grew ~1 MB per
    count without levelling off (benchmarks/bench_main_job_memory.py), and stays flat at these few."""
    if rows <= 8:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def _version(t: torch.Tensor) -> int:
    """How many times t was changed in place; 0 for a tensor made in inference mode, which does not count (the
    steps' activations are such, and they are not changed between two sibling calls)."""
    return 0 if t.is_inference() else t._version


def _groups(model: nn.Module) -> list[list[nn.Linear]]:
    """The packable layers, siblings (SIBLINGS, of the same input width) together, every other layer alone, in one
    walk of the model."""
    groups, linears, grouped = [], [], set()
    for module in model.modules():
        if _packable(module):
            linears.append(module)
        for names in SIBLINGS:
            layers = [module._modules.get(name) for name in names]
            if all(_packable(layer) and id(layer) not in grouped for layer in layers) \
                    and len({layer.in_features for layer in layers}) == 1:
                groups.append(layers)
                grouped.update(id(layer) for layer in layers)
    return groups + [[layer] for layer in linears if id(layer) not in grouped]


# Batch-1 decoding keeps copies (COLUMNS, PACKED) of at most this share of the linear weights' bytes: the groups whose
# copy saves the largest share of their matmul's time first, and only where it saves at least _ONE_ROW_MIN_GAIN
# (less is within the measurement's noise). The rest run on their weights, ROWS groups concatenated in place.
_ONE_ROW_COPY_SHARE = 1 / 2
_ONE_ROW_MIN_GAIN = 0.1


def _plan(groups: list[list[nn.Linear]], rows: int | None) -> list[tuple[list[nn.Linear], str]]:
    """[(group's layers, form of its copy)] for _groups' `groups` in a use at `rows` rows per step (None: many
    counts). At one row a group takes its shape's fastest form (one_row_times) while the copies stay within
    _ONE_ROW_COPY_SHARE of the weights, else ROWS (siblings concatenated in place; a lone layer is left out);
    otherwise (and under GPUFORMERS_CPU_PACKED_ROWS) every group is PACKED (none without oneDNN)."""
    if not _by_shape(rows):
        return [(layers, PACKED) for layers in groups] if prepack_available() else []
    forms, gains = {}, []
    for index, layers in enumerate(groups):
        times = one_row_times(layers[0].in_features, sum(layer.out_features for layer in layers))
        best = min(times, key=times.get)
        forms[index] = ROWS
        if best != ROWS and times[best] <= (1 - _ONE_ROW_MIN_GAIN) * times[ROWS]:
            gains.append((1 - times[best] / times[ROWS], index, best))
    budget = _ONE_ROW_COPY_SHARE * sum(_weight_bytes(layers) for layers in groups)
    for _, index, form in sorted(gains, key=lambda gain: -gain[0]):  # (a stable sort: the model's order on ties)
        if _weight_bytes(groups[index]) <= budget:
            budget -= _weight_bytes(groups[index])
            forms[index] = form
    return [(layers, forms[index]) for index, layers in enumerate(groups) if forms[index] != ROWS or len(layers) > 1]


def _weight_bytes(layers: list[nn.Linear]) -> int:
    return sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)


def _by_shape(rows: int | None) -> bool:
    """Whether a use at `rows` rows per step takes the in-place ROWS groups: batch-1 decoding, unless
    GPUFORMERS_CPU_PACKED_ROWS says where PACKED serves (then nothing else is copied)."""
    return rows == 1 and not os.environ.get(ENV)


def _plan_key(plan: list[tuple[list[nn.Linear], str]]) -> tuple:
    """What identifies a plan: its layers (kept alive by the copies, so their ids are not reused) and forms."""
    return tuple((tuple(id(layer) for layer in layers), form) for layers, form in plan)


class PackedLinears:
    """Copies of a model's plain float32 linear weights in the forms this CPU multiplies fastest (module docstring),
    and the switch that makes a block of work use them."""

    _lock = threading.Lock()

    def __init__(self, model: nn.Module, rows: int | None = None,
                 plan: list[tuple[list[nn.Linear], str]] | None = None):
        """Copies for a use at `rows` rows per step (None: many counts; 1: batch-1 decoding), or for `plan`."""
        plan = _plan(_groups(model), rows) if plan is None else plan
        self.key = _plan_key(plan)
        self.groups = [_PackedGroup(layers, form) for layers, form in plan]
        self._users = 0  # active() blocks running now, in any thread
        self._installed: list[nn.Linear] = []

    @property
    def layers(self) -> list[nn.Linear]:
        """The layers that have a copy."""
        return [layer for group in self.groups for layer in group.layers]

    @property
    def nbytes(self) -> int:
        """Memory the copies take beyond the layers' own weights (a ROWS group takes none)."""
        return sum(group.nbytes for group in self.groups)

    @contextlib.contextmanager
    def active(self):
        """Route the model's linear layers through their copies until the block ends. Blocks may nest or
        overlap across threads: the forwards are set by the first to enter and taken away by the last to leave."""
        with self._lock:
            _rule[:] = current_rule()  # read once per use, not per matmul
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


def packed_linears(model: nn.Module, rows: int | None = None,
                  plan: list[tuple[list[nn.Linear], str]] | None = None) -> PackedLinears:
    """The model's PackedLinears for a use at `rows` rows per step (or for `plan`), made at the first call and kept
    with the model (a weak reference: they go with it) while its layers and their forms stay the same, so that
    generate() and an engine on one model share one set of copies. A use that wants other forms replaces them."""
    plan = _plan(_groups(model), rows) if plan is None else plan
    kept = _kept_for(model, plan)
    if kept is None:
        _FOR_MODEL.pop(model, None)  # the old copies go first (unless an engine still holds them)
        kept = _FOR_MODEL[model] = PackedLinears(model, plan=plan)
    return kept


def _kept_for(model: nn.Module, plan: list[tuple[list[nn.Linear], str]]) -> PackedLinears | None:
    """The copies kept for `model` if they are this plan's."""
    kept = _FOR_MODEL.get(model)
    return kept if kept is not None and kept.key == _plan_key(plan) else None


def release(model: nn.Module) -> None:
    """Let go of the copies kept for `model`, if any."""
    _FOR_MODEL.pop(model, None)


def packed_for(model: nn.Module, rows: int | None = None) -> PackedLinears | None:
    """The copies generate() uses for `model` at `rows` rows per decode step (packed_linears), or None when they
    would not pay or not fit: no float32 linear layer on the CPU, at one row no sibling layers to concatenate, at
    several rows no oneDNN or no row count where it wins, or copies that would take more than a quarter of the
    available RAM (unless they are made already)."""
    groups = _groups(model)
    plan = _plan(groups, rows) if groups and (_by_shape(rows) or packs_some_rows()) else []
    if not plan:
        release(model)  # moved to a GPU or to bfloat16, say: the old copies are dead weight
        return None
    if _kept_for(model, plan) is None:
        copies = sum(_weight_bytes(layers) for layers, form in plan if form != ROWS)  # (ROWS copies nothing)
        if not copies_fit(copies):
            return None
    return packed_linears(model, plan=plan)


def copies_fit(nbytes: int) -> bool:
    """Whether copies of `nbytes` may be made automatically: at most a quarter of the available RAM (the rule of
    generate()'s copies and the engine's prepack_weights=None; True where the OS cannot say)."""
    ram = available_ram()
    return ram is None or nbytes <= ram // 4


_ONE_SHOT = contextvars.ContextVar("gpuformers_cpu_one_shot", default=False)


@contextlib.contextmanager
def one_shot():
    """A block that answers once and ends (`gpuformers generate`): generate() in it makes no copy and measures
    nothing, unless GPUFORMERS_CPU_PACKED_ROWS is set. The measurement (~50-80 ms a shape) and the copies cost more
    than the few dozen tokens of one answer save, and the copies' memory stays to the end (the main job's peak RSS,
    benchmarks/bench_main_job_memory.py)."""
    token = _ONE_SHOT.set(True)
    try:
        yield
    finally:
        _ONE_SHOT.reset(token)


def cpu_matmuls(model: nn.Module, rows: int | None = None):
    """The block a model's inference forwards run in (generate(), an assistant model, the embedding server): its
    packed_for copies for `rows` rows per step (None: many counts) active while the model is on the CPU; on a GPU
    (its layers offloaded to the CPU run there too, their weights copied in) nothing, and copies made while it was
    on the CPU go. Inside one_shot(), nothing (unless GPUFORMERS_CPU_PACKED_ROWS is set)."""
    if model.get_input_embeddings().weight.device.type != "cpu":
        release(model)
        return contextlib.nullcontext()
    if _ONE_SHOT.get() and not os.environ.get(ENV):
        return contextlib.nullcontext()
    packed = packed_for(model, rows)  # None without float32 linear layers, and copies made before go
    return packed.active() if packed is not None else contextlib.nullcontext()
