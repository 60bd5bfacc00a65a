"""The causal language-modelling loss: token t predicts token t+1, as transformers computes it.

Labels are shifted by one (the last position has no target), -100 is ignored, and the logits are upcast to
float32 first. With `num_items_in_batch` (gradient accumulation over several micro-batches) the sum is divided
by that count instead of averaging per micro-batch.

`linear_causal_lm_loss` takes the LM head's input instead of the logits. Its torch version walks the tokens in
chunks (CHUNK_TOKENS or more) and makes each chunk's loss and gradients (w.r.t. the hidden states and the LM-head
weight) in the forward, with the very ops autograd runs for the unfused loss, so one (chunk, vocab) float32 buffer
goes through logits -> log-softmax -> gradient in place (the CPU kernels allow it) instead of the three to four
(tokens, vocab) tensors autograd keeps or makes:

    for each chunk c:  z = h_c @ W^T  ->  log_softmax(z) in place  ->  loss_c = -sum(z[target])
                       z = log_softmax_backward(onehot(target) * -1/divisor, z) in place   # d loss / d logits
                       dh_c = z @ W        dW (+)= z^T @ h_c                               # the LM head's backward
    backward:          dh, dW times the incoming gradient (nothing to do when it is 1)

With one chunk the gradients are bitwise those of causal_lm_loss(F.linear(...)); with several, the weight gradient
is summed over the chunks (float32 rounding differs). The model uses it in training when the caller says the logits
will not be read (`logits_not_needed()`, which the Trainer's training step sets), or with use_kernels=True (the
Triton kernel).

Offers: causal_lm_loss, linear_causal_lm_loss, logits_not_needed, logits_needed (the label convention, IGNORE_INDEX
and shift_labels: gpuformers/labels.py).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from gpuformers.kernels.mapping import use_kernel_function
from gpuformers.labels import IGNORE_INDEX, shift_labels

# tokens per chunk of the chunked loss: at least CHUNK_TOKENS (fewer makes the (vocab, hidden) weight gradient,
# updated once per chunk, cost more than the logits saved), more when the vocabulary is small (CHUNK_ELEMENTS logits)
CHUNK_TOKENS, CHUNK_ELEMENTS = 1024, 2**22
_LOGITS_NOT_NEEDED = contextvars.ContextVar("gpuformers_logits_not_needed", default=False)


@contextlib.contextmanager
def logits_not_needed():
    """Within this block, a causal LM in train() mode given labels may return logits=None and compute its loss
    with linear_causal_lm_loss (the Trainer's training step: it never reads the logits)."""
    token = _LOGITS_NOT_NEEDED.set(True)
    try:
        yield
    finally:
        _LOGITS_NOT_NEEDED.reset(token)


def logits_needed() -> bool:
    """False inside logits_not_needed()."""
    return not _LOGITS_NOT_NEEDED.get()


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
    targets = shift_labels(labels, ignore_index).reshape(-1)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets, ignore_index=ignore_index, reduction=reduction)
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

    Equal to causal_lm_loss(F.linear(hidden_states, weight), ...), loss and gradients, without holding the
    (tokens, vocab) logits. Under autocast it computes the logits and calls causal_lm_loss."""
    device = hidden_states.device.type
    if (torch.is_autocast_enabled(device) or hidden_states.dtype != weight.dtype
            or not (hidden_states.dtype.is_floating_point and weight.dim() == 2)):
        return causal_lm_loss(F.linear(hidden_states, weight), labels, num_items_in_batch, ignore_index)
    labels = labels.to(hidden_states.device)
    targets = shift_labels(labels, ignore_index).reshape(-1)  # (tokens,)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # (tokens, hidden)
    if num_items_in_batch is None:  # a mean over the targets (0/0 = nan when there are none, as cross_entropy)
        divisor = (targets != ignore_index).sum()
    else:
        divisor = num_items_in_batch.to(hidden.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
    chunk = max(CHUNK_TOKENS, CHUNK_ELEMENTS // weight.shape[0])
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _chunked_loss_sum(hidden, weight, targets, ignore_index, chunk) / divisor
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, divisor, ignore_index, chunk)


def _chunked_loss_sum(hidden, weight, targets, ignore_index: int, chunk: int) -> torch.Tensor:
    """Sum of the token losses, no gradients: hidden (tokens, hidden), targets (tokens,)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start: start + chunk] @ weight.t()).float()  # (chunk, vocab)
        total = total + F.cross_entropy(logits, targets[start: start + chunk], ignore_index=ignore_index,
                                        reduction="sum")
    return total


def _rows_in_place(device: torch.device) -> bool:
    """Whether log_softmax and its backward may write over their input: the CPU kernels read a whole row before
    writing it; elsewhere they get a new buffer."""
    return device.type == "cpu"


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight^T, target) / divisor, the gradients made in the forward.

    Each step is the op autograd runs for the unfused loss (the same matmuls, log_softmax and its backward kernel,
    the same 1 / divisor), so with one chunk the gradients are bitwise those of causal_lm_loss(F.linear(...))."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, ignore_index: int, chunk: int):
        # hidden (tokens, hidden), weight (vocab, hidden), targets (tokens,), divisor: a number or a 0-dim tensor
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        in_place = _rows_in_place(hidden.device)
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        step = one / divisor  # d(loss)/d(each token's loss), computed as autograd computes it
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0).unsqueeze(1)  # (tokens, 1)
        # (tokens, 1): d(loss)/d(log-probability of the target), 0 on ignored rows (nll_loss's backward)
        nll_grad = torch.where(valid, -step, 0.0).unsqueeze(1)
        one_hot = hidden.new_zeros((min(chunk, tokens), vocab), dtype=torch.float32)  # reset after each chunk
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            h, rows, grad_out = hidden[start:end], safe[start:end], one_hot[: end - start]
            logits = (h @ weight.t()).float()  # (chunk, vocab)
            log_probs = torch.log_softmax(logits, dim=-1, out=logits if in_place else None)
            total = total - torch.where(valid[start:end], log_probs.gather(1, rows).squeeze(1), 0.0).sum()
            grad_out.scatter_(1, rows, nll_grad[start:end])
            grad_logits = torch._log_softmax_backward_data(grad_out, log_probs, -1, torch.float32,
                                                           out=log_probs if in_place else None)
            grad_out.scatter_(1, rows, 0.0)
            grad_logits = grad_logits.to(hidden.dtype)  # (chunk, vocab), as the cast of the logits sends it back
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if want_weight and tokens <= chunk:
                grad_weight = grad_logits.t().mm(h)  # (vocab, hidden)
            elif want_weight:  # summed over the chunks in float32
                if grad_weight is None:
                    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                grad_weight.addmm_(grad_logits.t().float(), h.float())
        # kept as attributes, not saved tensors: backward hands them over (no copy) and can then scale them in place
        ctx.grads = (grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads is None:
            raise RuntimeError("the chunked LM loss (linear_causal_lm_loss) cannot be backpropagated twice "
                               "(retain_graph=True): compute this loss outside logits_not_needed()")
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        # the gradients were made for grad_output = 1 (the usual case, checked on the CPU only: no device sync)
        if not (grad_output.device.type == "cpu" and grad_output.item() == 1.0):
            grad_hidden = grad_hidden.mul_(grad_output.to(grad_hidden.dtype)) if grad_hidden is not None else None
            grad_weight = grad_weight.mul_(grad_output) if grad_weight is not None else None
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None
