"""The two regularisers of transformers' Trainer: label smoothing of the loss (label_smoothing_factor) and NEFTune
noise on the input embeddings while training (neftune_noise_alpha).

Offers: label_smoothed_loss, add_neftune_noise.
"""

from __future__ import annotations

import torch

from gpuformers import distributed
from gpuformers.labels import IGNORE_INDEX


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, epsilon: float,
                        num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """transformers' LabelSmoother for a causal LM: logits (batch, seq, vocab), labels (batch, seq) -> scalar.

    Position t is scored against labels[t+1] (-100 ignored) with the target (1 - epsilon) on the label and
    epsilon / vocab on every token: (1 - epsilon) * NLL + epsilon * mean over the vocabulary of -log p, summed
    over the targets and divided by num_items_in_batch (the step's targets, all micro-batches), or averaged over
    this batch's targets without it. torch's cross_entropy(label_smoothing=) is that very sum."""
    logits = logits[..., :-1, :].float()
    targets = labels[..., 1:].to(logits.device)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=epsilon)
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum()
    elif torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def add_neftune_noise(model: torch.nn.Module, alpha: float):
    """NEFTune (arXiv 2310.05914), transformers' hook: the input embeddings (batch, seq, hidden) get uniform noise in
    [-s, s], s = alpha / sqrt(seq * hidden), while the model is in train() mode (never in evaluation). Returns the
    hook's handle; .remove() takes the noise off."""
    embeddings = distributed.unwrap(model).get_input_embeddings()

    def add_noise(module, inputs, output):
        if not module.training:
            return None
        # the scale in float32, as transformers computes it, so that a seed draws the very same noise
        scale = float(alpha / torch.tensor(output.size(1) * output.size(2)).sqrt())
        return output + torch.zeros_like(output).uniform_(-scale, scale)

    return embeddings.register_forward_hook(add_noise)
