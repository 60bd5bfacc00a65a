"""Model outputs: a dataclass that also reads like transformers' ModelOutput (`out.logits`, `out["logits"]`, `out[0]`).

Offers: ModelOutput, CausalLMOutput, MoeCausalLMOutput.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


class ModelOutput:
    """Attribute, key and index access over the fields that are not None, in declaration order."""

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None)

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key) -> bool:
        return key in self.keys()


@dataclass
class CausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (batch, seq, vocab)
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class MoeCausalLMOutput(ModelOutput):
    """A mixture-of-experts LM's output, fields in transformers' MoeCausalLMOutputWithPast order. With
    output_router_logits, `loss` includes router_aux_loss_coef * aux_loss."""

    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # the router's load-balancing loss
    logits: torch.Tensor | None = None  # (batch, seq, vocab)
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None  # one (batch * seq, experts) per sparse layer
