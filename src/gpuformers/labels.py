"""The causal-LM label convention, written once for the loss (layers/loss.py), its Triton kernels
(kernels/fused_linear_cross_entropy.py) and the Trainer's collators (training/data.py): a label of IGNORE_INDEX
scores nothing, and position t is scored against the label of token t+1.

Offers: IGNORE_INDEX, shift_labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # transformers' and torch's cross_entropy default


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """labels (batch, seq) -> the target of each position (batch, seq): position t is scored against labels[t+1],
    the last position against nothing (ignore_index)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
