"""CompileConfig: how `generate()` compiles its decode step, the `torch.compile` arguments, as transformers'.

Its own file so that both the config (generation/config.py) and its checks (generation/config_checks.py) can
import it.

Offers: CompileConfig (to_dict).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class CompileConfig:
    """How generate() compiles the decode step (`torch.compile` arguments), as transformers' CompileConfig."""

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"
    mode: str = "reduce-overhead"
    options: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
