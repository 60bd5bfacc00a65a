"""The causal language-modelling loss: token t predicts token t+1, as transformers computes it.

Labels are shifted by one (the last position has no target), -100 is ignored, and the logits are upcast to
float32 first. With `num_items_in_batch` (gradient accumulation over several micro-batches) the sum is divided
by that count instead of averaging per micro-batch.

Offers: causal_lm_loss, linear_causal_lm_loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuformers.kernels.mapping import use_kernel_function

IGNORE_INDEX = -100


@use_kernel_function("ForCausalLMLoss")  # use_kernels=True may route this to kernels/fused_linear_cross_entropy.py
def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """logits (batch, seq, vocab), labels (batch, seq) -> scalar loss."""
    logits = logits.float()
    labels = labels.to(logits.device)
    # (batch, seq): append one ignored label, then drop the first, so position t is scored against labels[t+1].
    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=ignore_index, reduction=reduction
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


@use_kernel_function("LinearForCausalLMLoss")  # use_kernels=True in training: the fused Triton linear + CE
def linear_causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The LM head and the loss in one call: hidden_states (batch, seq, hidden), weight (vocab, hidden).

    The torch version computes the logits and calls causal_lm_loss; the kernel never holds the whole
    (tokens, vocab) logits, which dominate training memory for large vocabularies."""
    return causal_lm_loss(F.linear(hidden_states, weight), labels, num_items_in_batch, ignore_index)

