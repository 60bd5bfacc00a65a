"""DoRA (weight-decomposed LoRA, peft's `LoraConfig(use_dora=True)`): a LoRA layer that also trains the length of
each output row of the updated weight, apart from its direction.

With W (out, in) the frozen weight, s the LoRA scaling and ||.|| the L2 norm of each output row (peft's dim=1 of the
(out, in) weight, the paper's column norm of W^T), the layer computes y = x W'^T + b with

    W' = m * (W + s B A) / ||W + s B A||          m (out,): lora_magnitude_vector, trained with A and B

m starts at ||W + s B A|| (so W' = W + s B A: with B = 0 the model is unchanged). As in the paper (section 4.3)
and peft, the norm is a constant for the backward: it follows A and B in the forward but passes no gradient.
The forward never builds W'; with n = ||W + s B A|| it adds to the base output (peft's arrangement):

    y = base_layer(x) + (m / n - 1) * (x W^T) + (m / n) * B(A(dropout(x))) * s

where x W^T is the base output less its bias, or, while dropout is active in training, x W^T recomputed on the
dropped-out input, as peft does. Merging writes W' into the base weight; unmerging divides it back out with the
norm kept from the merge (peft's cache), so it restores W up to rounding.

The magnitude is saved under peft's key `base_model.model.<module>.lora_magnitude_vector`. DoRA is for unquantized
nn.Linear layers only (LoraModel refuses the others).

Offers: DoraLinear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.lora.config import LoraConfig
from gpuformers.lora.layers import LoraLinear, broken_adapter_error


class DoraLinear(LoraLinear):
    """A LoraLinear over an nn.Linear with DoRA's trained magnitude (see the module docstring)."""

    def __init__(self, base_layer: nn.Linear, config: LoraConfig, autocast_adapter_dtype: bool = True):
        super().__init__(base_layer, config, autocast_adapter_dtype)
        weight = self.lora_A.weight
        self.lora_magnitude_vector = nn.Parameter(torch.empty(self.out_features, dtype=weight.dtype,
                                                              device=weight.device))
        self.reset_magnitude()
        self._merged_norm: torch.Tensor | None = None  # n at merge time (out,), to unmerge with

    @torch.no_grad()
    def reset_magnitude(self) -> None:
        """m = ||W + s B A|| per output row, as peft sets it when the adapter is created: computed in the base
        weight's dtype (peft computes it before it upcasts the adapters to float32), then stored in the adapters'."""
        weight = self.base_layer.weight  # (out, in)
        lora_weight = (self.lora_B.weight.float() @ self.lora_A.weight.float()).to(weight.dtype)
        self.lora_magnitude_vector.copy_(torch.linalg.norm(weight + self.scaling * lora_weight, dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged or self.disabled:
            return result
        x = x.to(self.lora_A.weight.dtype)
        weight = self.base_layer.weight.to(x.dtype)  # (out, in)
        with torch.no_grad():  # the norm is a constant for the backward (DoRA section 4.3, as peft)
            lora_weight = self.lora_B.weight @ self.lora_A.weight  # (out, in)
            norm = torch.linalg.norm(weight + self.scaling * lora_weight, dim=1)  # (out,)
        scale = self.lora_magnitude_vector / norm  # (out,), broadcast over the output's last dim
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            bias = self.base_layer.bias
            base = result if bias is None else result - bias  # x W^T: (..., out)
        else:
            x = self.lora_dropout(x)
            base = F.linear(x, weight)
        update = (scale - 1) * base + scale * self.lora_B(self.lora_A(x)) * self.scaling
        return (result + update).to(result.dtype)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False) -> None:
        """W <- m * (W + s B A) / ||W + s B A||, computed in float32 and rounded once to the weight's dtype."""
        if self.merged:
            return
        weight = self.base_layer.weight
        updated = weight.float() + self._delta()  # (out, in)
        norm = torch.linalg.norm(updated, dim=1)  # (out,)
        merged = (self.lora_magnitude_vector.float() / norm).unsqueeze(1) * updated
        if safe_merge and not torch.isfinite(merged).all():
            raise broken_adapter_error()
        weight.copy_(merged)
        self._merged_norm = norm
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        weight = self.base_layer.weight
        factor = (self.lora_magnitude_vector.float() / self._merged_norm).unsqueeze(1)  # (out, 1)
        weight.copy_(weight.float() / factor - self._delta())
        self._merged_norm = None
        self.merged = False

    def _delta(self) -> torch.Tensor:
        """s B A (out, in) in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, use_dora=True"
