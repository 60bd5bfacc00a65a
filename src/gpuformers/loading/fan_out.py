"""Checkpoint fan-out: rules for a checkpoint tensor that holds several of the model's tensors, and where each lies.

transformers 5 keeps a MoE layer's experts fused in memory, and saves them so when asked
(save_pretrained(save_original_format=False)), when the model is offloaded (device_map with CPU or disk offload)
or when it has a PEFT adapter loaded:

    model.layers.{i}.mlp.experts.gate_up_proj   (experts, 2 * intermediate, hidden)   gate rows, then up rows
    model.layers.{i}.mlp.experts.down_proj      (experts, hidden, intermediate)

Our MoE families keep one Linear per expert under the Hub's names (mlp.experts.{e}.gate_proj.weight, ...). A model
class declares `checkpoint_fan_out`, a tuple of FanOut rules, and the loader (weights.py) applies them to the
checkpoint keys the model does not have itself:

    FanOut("model.layers.*.mlp.experts.gate_up_proj",
           ("model.layers.*.mlp.experts.#.gate_proj.weight", "model.layers.*.mlp.experts.#.up_proj.weight"))

    source (E, 2I, H) --row e, for "#"--> (2I, H) --len(targets) equal blocks of rows--> target j: (I, H)

"*" stands for one dotted part of a name (a layer number) and is carried from the source to the targets in order;
"#" in the targets is the index along the source's dim 0 (one tensor per expert); what is left is cut along its
first dim into len(targets) equal blocks, in order. With one target and no "#", a rule is a rename. Either way
every piece is one contiguous run of the source's elements (row-major), so the loader reads each piece straight
from the file into its own parameter, in its final dtype and on its final device: a fused tensor is never held
whole.

Offers: FanOut, Piece, fused_experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import prod


@dataclass(frozen=True)
class Piece:
    """Our tensor `name` is elements [first, first + prod(shape)) of a checkpoint tensor (row-major), as `shape`."""

    name: str
    first: int
    shape: tuple[int, ...]


@dataclass
class FanOut:
    """One checkpoint tensor (`source`, a name pattern) -> the model's tensors `targets` (module doc)."""

    source: str
    targets: tuple[str, ...]
    _source_re: re.Pattern = field(init=False, repr=False)
    _target_res: list[tuple[re.Pattern, list[str]]] = field(init=False, repr=False)

    def __post_init__(self):
        self.targets = tuple(self.targets)
        stars = self.source.count("*")
        hashes = {t.count("#") for t in self.targets}
        same_stars = all(t.count("*") == stars for t in self.targets)
        if not self.targets or "#" in self.source or not same_stars or hashes not in ({0}, {1}):
            raise ValueError(f"FanOut({self.source!r}, {self.targets!r}): give one or more targets, each with the "
                             f"source's {stars} '*' and, in all of them or none, one '#' (the index along dim 0)")
        self._source_re, _ = _compile(self.source)
        self._target_res = [_compile(t) for t in self.targets]

    @property
    def indexed(self) -> bool:
        return "#" in self.targets[0]

    def matches(self, key: str) -> bool:
        """Whether checkpoint key `key` is this rule's source."""
        return self._source_re.fullmatch(key) is not None

    def source_of(self, name: str) -> str | None:
        """The checkpoint key that holds our tensor `name` under this rule, or None when no target matches it."""
        for pattern, wildcards in self._target_res:
            match = pattern.fullmatch(name)
            if match:
                stars = iter(g for g, w in zip(match.groups(), wildcards) if w == "*")
                return re.sub(r"\*", lambda _: next(stars), self.source)
        return None

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[Piece] | None:
        """Our tensors inside checkpoint tensor `key` of `shape`, in file order; None when `key` is not the source."""
        match = self._source_re.fullmatch(key)
        if match is None:
            return None
        inner = shape[1:] if self.indexed else shape
        count = shape[0] if self.indexed else 1
        if not inner or inner[0] % len(self.targets):
            dim = "its second dim (after the experts')" if self.indexed else "its first dim"
            raise ValueError(f"checkpoint tensor {key!r} has shape {list(shape)}; cutting it into "
                             f"{', '.join(self.targets)} needs {dim} to split into {len(self.targets)} equal blocks: "
                             f"is config.json the one of these weights?")
        block = (inner[0] // len(self.targets),) + tuple(inner[1:])
        out = []
        for e in range(count):
            for j, target in enumerate(self.targets):
                stars = iter(match.groups())
                name = re.sub(r"[*#]", lambda m: str(e) if m.group() == "#" else next(stars), target)
                out.append(Piece(name, e * prod(inner) + j * prod(block), block))
        return out


def fused_experts(ours: str = "model.layers.*.mlp.experts", gate: str = "gate_proj", up: str = "up_proj",
                  down: str = "down_proj") -> tuple[FanOut, FanOut]:
    """The rules for transformers' fused experts (model.layers.*.mlp.experts.gate_up_proj / down_proj) -> our
    per-expert Linears `{ours}.{e}.{gate,up,down}.weight`."""
    fused = "model.layers.*.mlp.experts"
    return (FanOut(f"{fused}.gate_up_proj", (f"{ours}.#.{gate}.weight", f"{ours}.#.{up}.weight")),
            FanOut(f"{fused}.down_proj", (f"{ours}.#.{down}.weight",)))


def _compile(pattern: str) -> tuple[re.Pattern, list[str]]:
    """A name pattern -> (regex with one group per wildcard, the wildcards in order)."""
    wildcards = re.findall(r"[*#]", pattern)
    parts = re.split(r"[*#]", pattern)
    regex = re.escape(parts[0])
    for wildcard, part in zip(wildcards, parts[1:]):
        regex += (r"([^.]+)" if wildcard == "*" else r"(\d+)") + re.escape(part)
    return re.compile(regex), wildcards
