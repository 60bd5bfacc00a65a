"""Cross-entropy as a Triton kernel that writes its gradient during the forward, and fused linear +
cross-entropy that never materialises the full (tokens, vocab) logits.

    cross_entropy:  one program per row: pass 1 finds logsumexp over the vocab in BLOCK_V tiles (online max/sum),
                    pass 2 writes d loss / d logits = (softmax - onehot(label)) * scale
    fused:          for each chunk of C tokens: logits_c = hidden_c @ weight^T (C, vocab) -> the kernel above turns
                    them into their gradient in place -> grad_hidden_c = g @ weight, grad_weight += g^T @ hidden_c

So the peak holds one (C, vocab) chunk instead of the (tokens, vocab) logits plus their float32 copy and gradient.
Labels equal to ignore_index (-100) add nothing; the mean divides by the number of counted labels, or by
num_items_in_batch when given (gradient accumulation), as layers/loss.py does.

Under torch.compile, cross_entropy and fused_linear_cross_entropy call the torch.library ops of ops.py
(gpuformers::cross_entropy, gpuformers::fused_linear_cross_entropy) instead of their autograd.Functions.

Offers: cross_entropy, causal_lm_loss_triton, fused_linear_cross_entropy, linear_causal_lm_loss_triton,
fused_linear_cross_entropy_reference, fused_forward, CrossEntropyFunction, FusedLinearCrossEntropyFunction,
cross_entropy_rows (the kernel launch, per-row losses; ops.py's torch.library op calls it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpuformers.kernels import ops
from gpuformers.kernels.checks import check_same, check_tensor, next_power_of_2
from gpuformers.labels import IGNORE_INDEX, shift_labels


@triton.jit
def _cross_entropy_kernel(LOGITS, LABELS, LOSS, GRAD, SCALE, stride_logits, stride_grad, n_vocab, ignore_index,
                          WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row).to(tl.int64)
    base = LOGITS + row * stride_logits
    offs = tl.arange(0, BLOCK_V)
    x = tl.load(base + offs, mask=offs < n_vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    total = tl.sum(tl.exp(x - m), axis=0)
    for start in range(BLOCK_V, n_vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(total)
    ignored = label == ignore_index
    target = tl.load(base + tl.where(ignored, 0, label)).to(tl.float32)
    tl.store(LOSS + row, tl.where(ignored, 0.0, lse - target))
    if WRITE_GRAD:
        scale = tl.where(ignored, 0.0, tl.load(SCALE))
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_vocab, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
            tl.store(GRAD + row * stride_grad + cols, (grad * scale).to(GRAD.dtype.element_ty), mask=cols < n_vocab)


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor | None, scale: torch.Tensor,
                       ignore_index: int) -> torch.Tensor:
    """logits (rows, vocab), labels (rows,) -> per-row loss (rows,) float32; fills grad (rows, vocab) if given."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(next_power_of_2(vocab), 4096 if logits.is_cuda else 1024)
        _cross_entropy_kernel[(rows,)](
            logits, labels, loss, grad if grad is not None else logits, scale,
            logits.stride(0), grad.stride(0) if grad is not None else 0, vocab, ignore_index,
            WRITE_GRAD=grad is not None, BLOCK_V=block, num_warps=8 if logits.is_cuda else 1,
        )
    return loss


def _check_labels(labels: torch.Tensor, rows: int, device, vocab: int, ignore_index: int) -> None:
    if labels.dtype not in (torch.int64, torch.int32) or labels.numel() != rows:
        raise ValueError(f"labels must be {rows} int64 class indices, got {labels.dtype} {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels are on {labels.device} but the logits are on {device}")
    if rows and not torch.compiler.is_compiling():
        # The kernel would read the "target" logit outside the row. Checked on the device, without a host sync: on a
        # GPU a failed check is a device-side assert (as torch's own cross_entropy gives), on the CPU a RuntimeError.
        valid = ((labels >= 0) & (labels < vocab)) | (labels == ignore_index)
        torch._assert_async(valid.all(), f"labels must be class indices in [0, {vocab}) or ignore_index "
                                         f"({ignore_index})")


def _inverse_count(labels, ignore_index, num_items_in_batch) -> torch.Tensor:
    # (1,) float32 on the labels' device: the 1/denominator the mean uses, with no host sync.
    if num_items_in_batch is None:
        count = (labels != ignore_index).sum().float()
    elif torch.is_tensor(num_items_in_batch):
        count = num_items_in_batch.to(device=labels.device, dtype=torch.float32)
    else:
        count = torch.tensor(float(num_items_in_batch), device=labels.device)
    return (1.0 / count).reshape(1)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, num_items_in_batch):
        scale = _inverse_count(labels, ignore_index, num_items_in_batch)
        grad = torch.empty_like(logits) if logits.requires_grad else None
        loss = cross_entropy_rows(logits, labels, grad, scale, ignore_index).sum() * scale[0]
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                  num_items_in_batch=None) -> torch.Tensor:
    """Mean cross-entropy of logits (rows, vocab) against labels (rows,), in float32; differentiable."""
    check_tensor("logits", logits, ndim=2)
    _check_labels(labels, logits.shape[0], logits.device, logits.shape[1], ignore_index)
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        scale = _inverse_count(labels, ignore_index, num_items_in_batch)
        with_grad = torch.is_grad_enabled() and logits.requires_grad
        return ops.cross_entropy(logits, labels.reshape(-1), scale, ignore_index, with_grad)[0]
    return CrossEntropyFunction.apply(logits, labels.reshape(-1), ignore_index, num_items_in_batch)


def causal_lm_loss_triton(logits, labels, num_items_in_batch=None, ignore_index: int = IGNORE_INDEX):
    """Drop-in for layers/loss.py causal_lm_loss: logits (batch, seq, vocab), labels (batch, seq) -> scalar."""
    targets = shift_labels(labels.to(logits.device), ignore_index).reshape(-1)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index, num_items_in_batch)


def fused_forward(hidden, weight, labels, scale, ignore_index: int, chunk_size: int, grad_hidden: bool,
                  grad_weight: bool):
    """The chunked loop: (mean loss, d loss / d hidden or None, d loss / d weight or None), the gradients written
    during the forward for the inputs that asked for them. scale (1,) float32 is 1 / the mean's denominator."""
    rows = hidden.shape[0]
    want_grad = grad_hidden or grad_weight
    dhidden = torch.empty_like(hidden) if grad_hidden else None
    # Accumulated in the weight's dtype: each chunk's GEMM sums in float32 and rounds once, as Liger and the
    # unfused torch backward (one big GEMM, rounded once) do; a float32 buffer would double the peak memory.
    dweight = torch.zeros_like(weight) if grad_weight else None
    losses = []
    for start in range(0, rows, chunk_size):
        h = hidden[start:start + chunk_size]  # (C, hidden)
        logits = h @ weight.t()  # (C, vocab): the only logits that ever exist
        losses.append(cross_entropy_rows(logits, labels[start:start + chunk_size], logits if want_grad else None,
                                         scale, ignore_index))
        if dhidden is not None:
            torch.matmul(logits, weight, out=dhidden[start:start + chunk_size])
        if dweight is not None:
            dweight.addmm_(logits.t(), h)
    loss = (torch.cat(losses).sum() if losses else hidden.new_zeros((), dtype=torch.float32)) * scale[0]
    return loss, dhidden, dweight


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, num_items_in_batch, chunk_size):
        scale = _inverse_count(labels, ignore_index, num_items_in_batch)
        loss, grad_hidden, grad_weight = fused_forward(hidden, weight, labels, scale, ignore_index, chunk_size,
                                                       hidden.requires_grad, weight.requires_grad)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_output.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = IGNORE_INDEX, num_items_in_batch=None,
                               chunk_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of (hidden @ weight^T) against labels without the full logits.

    hidden (tokens, hidden_size), weight (vocab, hidden_size) (the LM head), labels (tokens,) already aligned with
    hidden (shift them first for causal LM). chunk_size defaults to about tokens / (vocab / hidden_size), so a
    chunk's logits are about as large as the hidden states.
    """
    check_tensor("hidden", hidden, ndim=2)
    check_tensor("weight", weight, ndim=2)
    check_same("dtype", hidden=hidden, weight=weight)
    check_same("device", hidden=hidden, weight=weight)
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden has size {hidden.shape[1]} but weight (vocab, hidden) is {tuple(weight.shape)}")
    _check_labels(labels, hidden.shape[0], hidden.device, weight.shape[0], ignore_index)
    rows, vocab = hidden.shape[0], weight.shape[0]
    if chunk_size is None:
        chunk_size = max(1, triton.cdiv(rows, max(1, triton.cdiv(vocab, hidden.shape[1]))))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        scale = _inverse_count(labels, ignore_index, num_items_in_batch)
        grad = torch.is_grad_enabled()
        return ops.fused_linear_cross_entropy(hidden, weight, labels.reshape(-1), scale, ignore_index, int(chunk_size),
                                              grad and hidden.requires_grad, grad and weight.requires_grad)[0]
    return FusedLinearCrossEntropyFunction.apply(hidden, weight, labels.reshape(-1), ignore_index,
                                                 num_items_in_batch, int(chunk_size))


def fused_linear_cross_entropy_reference(hidden, weight, labels, ignore_index=IGNORE_INDEX, num_items_in_batch=None):
    """The unfused torch computation: full logits in float32, then cross-entropy."""
    logits = (hidden @ weight.t()).float()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, labels, ignore_index=ignore_index)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


def linear_causal_lm_loss_triton(hidden_states, weight, labels, num_items_in_batch=None,
                                 ignore_index: int = IGNORE_INDEX):
    """layers/loss.py's linear_causal_lm_loss fused: hidden_states (batch, seq, hidden), labels (batch, seq),
    shifted by one as transformers does, then fused_linear_cross_entropy over the flattened tokens."""
    shifted = shift_labels(labels.to(hidden_states.device), ignore_index)
    return fused_linear_cross_entropy(hidden_states.reshape(-1, hidden_states.shape[-1]), weight,
                                      shifted.reshape(-1), ignore_index, num_items_in_batch)

