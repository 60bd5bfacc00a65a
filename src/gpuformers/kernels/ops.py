"""The Triton kernels as torch.library operators under the `gpuformers` namespace, so that torch.compile keeps them
in its graph (no graph break) and can differentiate through them.

    op (torch.ops.gpuformers.*)                                        backward
    rms_norm(x, weight, eps) -> (y, rstd)                              rms_norm_backward
    add_rms_norm(x, residual, weight, eps) -> (y, x + residual, rstd)  rms_norm_backward (with the residual's grad)
    silu_and_mul(gate, up) -> y                                        silu_and_mul_backward
    silu(x) -> y                                                       silu_and_mul_backward (without up)
    rotary(x, cos, sin, unsqueeze_dim, inverse) -> y                   rotary with `inverse` flipped
    flash_attention(q, k, v, causal, scale, window, mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        -> (out, lse)                                                  flash_attention_backward
    cross_entropy(logits, labels, inv_count, ignore_index, with_grad) -> (loss, grad_logits)
    fused_linear_cross_entropy(hidden, weight, labels, inv_count, ignore_index, chunk_size, grad_hidden, grad_weight)
        -> (loss, grad_hidden, grad_weight)                            the gradients it returned, times d loss
    ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, chunk_size, dt_min, dt_max, initial_state) -> (y, state)
                                                                       ssd_chunk_scan_backward (recomputes the states)
    ssm_state_step(state, x, dt, A, B, C, D, dt_bias) -> (y, state)    none (decode only)
    causal_conv1d(x, conv_state, weight, bias) -> (out, conv_state)    causal_conv1d_backward
    ssm_state_step_indexed(states, rows, x, dt, A, B, C, D, dt_bias) -> y   none (decode only; mutates states)
    causal_conv1d_indexed(x, conv_states, rows, weight, bias) -> out   none (decode only; mutates conv_states)

Each op runs the kernel file's launcher, with its shape, stride and dtype checks (the loss functions check their
inputs before calling their op, while torch.compile traces); its fake implementation gives the compiler output
shapes, strides and dtypes without running anything. Outputs kept only for the backward
(rstd, lse, gradients written in the forward) are marked non-differentiable. The loss ops write their gradient
during the forward, as their eager autograd.Functions do, so they take flags saying which gradients to write
(empty tensors stand for the others).

The public kernel functions (rms_norm, silu_and_mul, apply_rotary, flash_attention, cross_entropy, ...) call these
ops when torch.compiler.is_compiling(), and their autograd.Functions otherwise (cheaper to dispatch in eager).

These are `torch.library.custom_op`s: Inductor calls them as they are. `torch.library.triton_op` would let Inductor
see the Triton kernels, but its fake implementation is the op's own Python, which launches the kernels; under the
Triton interpreter (the CPU tests) `wrap_triton` hands back the plain kernel and the launch fails on fake tensors,
so that path could not be tested here.

Importing this file registers the ops and imports neither triton nor the kernel files (the op bodies do).

Offers: NAMESPACE, OP_NAMES and the ops (rms_norm, add_rms_norm, rms_norm_backward, silu_and_mul, silu,
silu_and_mul_backward, rotary, flash_attention, flash_attention_backward, cross_entropy, fused_linear_cross_entropy,
ssd_chunk_scan, ssd_chunk_scan_backward, ssm_state_step, causal_conv1d, causal_conv1d_backward,
ssm_state_step_indexed, causal_conv1d_indexed).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

NAMESPACE = "gpuformers"


def _empty(like: torch.Tensor) -> torch.Tensor:
    # Stands for a gradient the caller did not ask for (an op output cannot be None).
    return like.new_empty(0)


# --- RMSNorm and residual-add + RMSNorm (kernels/rms_norm.py) --------------------------------------------------

@custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from gpuformers.kernels.rms_norm import rms_norm_forward

    y, _, rstd = rms_norm_forward(x, weight, eps)
    return y, rstd


def _rms_norm_outputs(x, weight):
    # y (like x, in the promoted dtype) and rstd (rows,) float32, as rms_norm_forward allocates them
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(rows, dtype=torch.float32)


@rms_norm.register_fake
def _(x, weight, eps):
    return _rms_norm_outputs(x, weight)


@custom_op(f"{NAMESPACE}::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from gpuformers.kernels.rms_norm import rms_norm_forward

    return rms_norm_forward(x, weight, eps, residual)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    y, rstd = _rms_norm_outputs(x, weight)
    return y, x.new_empty(x.shape), rstd  # contiguous, as rms_norm_forward allocates it


@custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dresidual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x is the normalised input (x + residual when fused); dresidual the gradient of that sum's output."""
    from gpuformers.kernels.rms_norm import rms_norm_backward as launch

    dx, dweight = launch(dy, x, weight, rstd, dresidual)
    return dx, dweight


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, dresidual):
    return x.new_empty(x.shape), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward(dy, x, weight, rstd, None)
    return dx, dweight, None


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _ = inputs
    y, summed, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(summed, weight, rstd)


def _add_rms_norm_grad(ctx, dy, dsummed, _drstd):
    summed, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward(dy, summed, weight, rstd, dsummed)
    return dx, dx, dweight, None  # x and residual enter only through their sum


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)
add_rms_norm.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup)


# --- SiLU and SiLU-and-mul (kernels/swiglu.py) ------------------------------------------------------------------

@custom_op(f"{NAMESPACE}::silu_and_mul", mutates_args=())
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from gpuformers.kernels.swiglu import silu_and_mul_forward

    return silu_and_mul_forward(gate, up)


@custom_op(f"{NAMESPACE}::silu", mutates_args=())
def silu(x: torch.Tensor) -> torch.Tensor:
    from gpuformers.kernels.swiglu import silu_and_mul_forward

    return silu_and_mul_forward(x, None)


@silu_and_mul.register_fake
def _(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@silu.register_fake
def _(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@custom_op(f"{NAMESPACE}::silu_and_mul_backward", mutates_args=())
def silu_and_mul_backward(dy: torch.Tensor, gate: torch.Tensor,
                          up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup); without up (plain silu) dup is empty."""
    from gpuformers.kernels.swiglu import silu_and_mul_backward as launch

    dgate, dup = launch(dy, gate, up)
    return dgate, (dup if dup is not None else _empty(gate))


@silu_and_mul_backward.register_fake
def _(dy, gate, up):
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    return dgate, (torch.empty_like(dgate) if up is not None else _empty(gate))


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_and_mul_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    return silu_and_mul_backward(dy, gate, up)


def _silu_grad(ctx, dy):
    (x,) = ctx.saved_tensors
    return silu_and_mul_backward(dy, x, None)[0]


silu_and_mul.register_autograd(_silu_and_mul_grad, setup_context=_save_inputs)
silu.register_autograd(_silu_grad, setup_context=_save_inputs)


# --- rotary embedding (kernels/rotary.py) -----------------------------------------------------------------------

@custom_op(f"{NAMESPACE}::rotary", mutates_args=())
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
           inverse: bool) -> torch.Tensor:
    """x rotated by the angles in cos/sin (by minus them when inverse: the backward); a new tensor like x."""
    from gpuformers.kernels.rotary import rotary_forward

    return rotary_forward(x, cos, sin, unsqueeze_dim=unsqueeze_dim, backward=inverse)


@rotary.register_fake
def _(x, cos, sin, unsqueeze_dim, inverse):
    return torch.empty_like(x)


def _rotary_setup(ctx, inputs, output):
    _, cos, sin, unsqueeze_dim, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim, ctx.inverse = unsqueeze_dim, inverse


def _rotary_grad(ctx, dy):
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise NotImplementedError("gpuformers::rotary has no gradient for cos and sin; use the torch "
                                  "apply_rotary_pos_emb for learned rotary tables")
    cos, sin = ctx.saved_tensors
    return rotary(dy.contiguous(), cos, sin, ctx.unsqueeze_dim, not ctx.inverse), None, None, None, None


rotary.register_autograd(_rotary_grad, setup_context=_rotary_setup)


# --- attention (kernels/attention.py) ---------------------------------------------------------------------------

@custom_op(f"{NAMESPACE}::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window: int,
                    mask: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                    max_seqlen_q: int, max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): window 0 means none; max_seqlen_* are used with cu_seqlens_* (packed sequences) only."""
    from gpuformers.kernels.attention import AttentionProblem, attention_forward

    problem = AttentionProblem(q, k, v, causal, window or None, mask, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q or None, max_seqlen_k or None)
    return attention_forward(problem, q, k, v, scale)


@flash_attention.register_fake
def _(q, k, v, causal, scale, window, mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    if cu_seqlens_q is not None:  # packed: out like q, lse (heads, total_q)
        total_q, heads, head_dim = q.shape
        return (q.new_empty(total_q, heads, head_dim),
                q.new_empty(heads, total_q, dtype=torch.float32))
    # out (batch, q_len, heads, dim) memory seen as (batch, heads, q_len, dim), as the launcher allocates it
    batch, heads, q_len, head_dim = q.shape
    out = q.new_empty(batch, q_len, heads, head_dim).transpose(1, 2)
    return out, q.new_empty(batch, heads, q_len, dtype=torch.float32)


@custom_op(f"{NAMESPACE}::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, window: int,
                             mask: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                             cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
                             max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from gpuformers.kernels.attention import AttentionProblem, attention_backward

    problem = AttentionProblem(q, k, v, causal, window or None, mask, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q or None, max_seqlen_k or None)
    return attention_backward(problem, q, k, v, out, lse, dout, scale)


@flash_attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, window, mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, window, mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, mask, cu_seqlens_q, cu_seqlens_k)
    ctx.options = causal, scale, window, max_seqlen_q, max_seqlen_k


def _attention_grad(ctx, dout, _dlse):
    q, k, v, out, lse, mask, cu_q, cu_k = ctx.saved_tensors
    causal, scale, window, max_q, max_k = ctx.options
    dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal, scale, window, mask, cu_q, cu_k,
                                          max_q, max_k)
    return dq, dk, dv, None, None, None, None, None, None, None, None


flash_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


# --- cross-entropy and fused linear + cross-entropy (kernels/fused_linear_cross_entropy.py) --------------------

@custom_op(f"{NAMESPACE}::cross_entropy", mutates_args=())
def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, inv_count: torch.Tensor, ignore_index: int,
                  with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, d loss / d logits) for logits (rows, vocab); the gradient is empty unless with_grad.
    inv_count (1,) float32 is 1 / the number of counted labels (or of num_items_in_batch)."""
    from gpuformers.kernels.fused_linear_cross_entropy import cross_entropy_rows

    grad = torch.empty_like(logits) if with_grad else _empty(logits)
    loss = cross_entropy_rows(logits, labels, grad if with_grad else None, inv_count,
                              ignore_index).sum() * inv_count[0]
    return loss, grad


@cross_entropy.register_fake
def _(logits, labels, inv_count, ignore_index, with_grad):
    grad = torch.empty_like(logits) if with_grad else _empty(logits)
    return logits.new_empty((), dtype=torch.float32), grad


def _cross_entropy_setup(ctx, inputs, output):
    _, grad = output
    ctx.mark_non_differentiable(grad)
    ctx.save_for_backward(grad)
    ctx.with_grad = inputs[-1]


def _cross_entropy_grad(ctx, dloss, _dgrad):
    if ctx.needs_input_grad[0] and not ctx.with_grad:
        raise RuntimeError("gpuformers::cross_entropy was called with with_grad=False, so it wrote no gradient; "
                           "call it with with_grad=True when the logits need one")
    (grad,) = ctx.saved_tensors
    return (grad * dloss.to(grad.dtype) if ctx.with_grad else None), None, None, None, None


cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


@custom_op(f"{NAMESPACE}::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               inv_count: torch.Tensor, ignore_index: int, chunk_size: int, grad_hidden: bool,
                               grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, d loss / d hidden, d loss / d weight); a gradient not asked for comes back empty."""
    from gpuformers.kernels.fused_linear_cross_entropy import fused_forward

    loss, dhidden, dweight = fused_forward(hidden, weight, labels, inv_count, ignore_index, chunk_size, grad_hidden,
                                           grad_weight)
    return (loss, dhidden if dhidden is not None else _empty(hidden),
            dweight if dweight is not None else _empty(weight))


@fused_linear_cross_entropy.register_fake
def _(hidden, weight, labels, inv_count, ignore_index, chunk_size, grad_hidden, grad_weight):
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if grad_hidden else _empty(hidden),
            torch.empty_like(weight) if grad_weight else _empty(weight))


def _fused_setup(ctx, inputs, output):
    _, dhidden, dweight = output
    ctx.mark_non_differentiable(dhidden, dweight)
    ctx.save_for_backward(dhidden, dweight)
    ctx.flags = inputs[-2:]  # grad_hidden, grad_weight: which gradients the forward wrote


def _fused_grad(ctx, dloss, _dhidden, _dweight):
    dhidden, dweight = ctx.saved_tensors
    wrote_hidden, wrote_weight = ctx.flags
    for index, wrote, name in ((0, wrote_hidden, "grad_hidden"), (1, wrote_weight, "grad_weight")):
        if ctx.needs_input_grad[index] and not wrote:
            raise RuntimeError(f"gpuformers::fused_linear_cross_entropy was called with {name}=False, so it wrote "
                               f"no gradient; call it with {name}=True")
    return (dhidden * dloss.to(dhidden.dtype) if wrote_hidden else None,
            dweight * dloss.to(dweight.dtype) if wrote_weight else None, None, None, None, None, None, None)


fused_linear_cross_entropy.register_autograd(_fused_grad, setup_context=_fused_setup)



# --- the Mamba2 mixer (kernels/ssd.py, kernels/causal_conv1d.py, kernels/ssd_backward.py) -----------------------
# The scan and the conv have a backward (the train() mode kernels call these ops while torch.compile traces); the
# decode step has none (the inference kernel function calls it only when no gradient is needed).

@custom_op(f"{NAMESPACE}::ssd_chunk_scan", mutates_args=())
def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, dt_bias: torch.Tensor, chunk_size: int, dt_min: float, dt_max: float,
                   initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from gpuformers.kernels.ssd import ssd_chunk_scan_forward

    return ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, chunk_size, (dt_min, dt_max), initial_state)


@ssd_chunk_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, chunk_size, dt_min, dt_max, initial_state):
    batch, _, heads, head_dim = x.shape  # y (batch, seq, heads, head_dim), state (batch, heads, head_dim, state)
    return x.new_empty(x.shape, dtype=torch.float32), x.new_empty((batch, heads, head_dim, B.shape[-1]),
                                                                  dtype=torch.float32)


@custom_op(f"{NAMESPACE}::ssd_chunk_scan_backward", mutates_args=())
def ssd_chunk_scan_backward(dy: torch.Tensor, dfinal: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                            A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                            chunk_size: int, dt_min: float, dt_max: float, initial_state: torch.Tensor | None,
                            final: torch.Tensor) -> list[torch.Tensor]:
    """[dx, ddt, dA, dB, dC, dD, ddt_bias, d initial_state (empty without one)]; recomputes the forward's chunk
    states (the forward op does not return them)."""
    from gpuformers.kernels.ssd_backward import ssd_chunk_scan_backward as launch

    grads = launch(dy, dfinal, x, dt, A, B, C, D, dt_bias, chunk_size, (dt_min, dt_max), initial_state, final)
    return [*grads[:7], grads[7] if grads[7] is not None else _empty(x)]


@ssd_chunk_scan_backward.register_fake
def _(dy, dfinal, x, dt, A, B, C, D, dt_bias, chunk_size, dt_min, dt_max, initial_state, final):
    # all contiguous, as the launcher returns them
    return [*(t.new_empty(t.shape) for t in (x, dt, A, B, C, D, dt_bias)),
            initial_state.new_empty(initial_state.shape) if initial_state is not None else _empty(x)]


def _ssd_chunk_scan_setup(ctx, inputs, output):
    x, dt, A, B, C, D, dt_bias, chunk_size, dt_min, dt_max, initial_state = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, initial_state, output[1])
    ctx.options = chunk_size, dt_min, dt_max


def _ssd_chunk_scan_grad(ctx, dy, dfinal):
    x, dt, A, B, C, D, dt_bias, initial_state, final = ctx.saved_tensors
    grads = ssd_chunk_scan_backward(dy, dfinal, x, dt, A, B, C, D, dt_bias, *ctx.options, initial_state, final)
    return (*grads[:7], None, None, None, grads[7] if initial_state is not None else None)


ssd_chunk_scan.register_autograd(_ssd_chunk_scan_grad, setup_context=_ssd_chunk_scan_setup)


@custom_op(f"{NAMESPACE}::ssm_state_step", mutates_args=())
def ssm_state_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from gpuformers.kernels.ssd import ssm_state_step_forward

    return ssm_state_step_forward(state, x, dt, A, B, C, D, dt_bias)


@ssm_state_step.register_fake
def _(state, x, dt, A, B, C, D, dt_bias):
    return x.new_empty(x.shape, dtype=torch.float32), state.new_empty(state.shape, dtype=torch.float32)


@custom_op(f"{NAMESPACE}::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from gpuformers.kernels.causal_conv1d import causal_conv1d_forward

    return causal_conv1d_forward(x, conv_state, weight, bias)


@causal_conv1d.register_fake
def _(x, conv_state, weight, bias):
    # out (batch, seq, channels) contiguous, new state (batch, channels, kernel - 1), both in x's dtype
    return x.new_empty(x.shape), x.new_empty((x.shape[0], x.shape[2], weight.shape[-1] - 1))


@custom_op(f"{NAMESPACE}::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(dout: torch.Tensor, dnew_state: torch.Tensor, x: torch.Tensor,
                           conv_state: torch.Tensor | None, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> list[torch.Tensor]:
    """[dx, d conv_state, d weight, d bias]; the state's and the bias's are empty when they were not given."""
    from gpuformers.kernels.causal_conv1d import causal_conv1d_backward as launch

    dx, dstate, dweight, dbias = launch(dout, dnew_state, x, conv_state, weight, bias)
    return [dx, dstate if dstate is not None else _empty(x), dweight, dbias if dbias is not None else _empty(x)]


@causal_conv1d_backward.register_fake
def _(dout, dnew_state, x, conv_state, weight, bias):
    # all contiguous, as the launcher returns them
    return [x.new_empty(x.shape), conv_state.new_empty(conv_state.shape) if conv_state is not None else _empty(x),
            weight.new_empty(weight.shape), bias.new_empty(bias.shape) if bias is not None else _empty(x)]


def _causal_conv1d_grad(ctx, dout, dnew_state):
    x, conv_state, weight, bias = ctx.saved_tensors
    dx, dstate, dweight, dbias = causal_conv1d_backward(dout, dnew_state, x, conv_state, weight, bias)
    return dx, (dstate if conv_state is not None else None), dweight, (dbias if bias is not None else None)


causal_conv1d.register_autograd(_causal_conv1d_grad, setup_context=_save_inputs)


@custom_op(f"{NAMESPACE}::ssm_state_step_indexed", mutates_args=("states",))
def ssm_state_step_indexed(states: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                           dt_bias: torch.Tensor) -> torch.Tensor:
    """The state step on rows `rows` of the pool `states`, written back in place (the engine's state slots)."""
    from gpuformers.kernels.ssd import ssm_state_step_indexed_forward

    return ssm_state_step_indexed_forward(states, rows, x, dt, A, B, C, D, dt_bias)


@ssm_state_step_indexed.register_fake
def _(states, rows, x, dt, A, B, C, D, dt_bias):
    return x.new_empty(x.shape, dtype=torch.float32)


@custom_op(f"{NAMESPACE}::causal_conv1d_indexed", mutates_args=("conv_states",))
def causal_conv1d_indexed(x: torch.Tensor, conv_states: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The one-token conv update on rows `rows` of the pool `conv_states`, written back in place."""
    from gpuformers.kernels.causal_conv1d import causal_conv1d_indexed_forward

    return causal_conv1d_indexed_forward(x, conv_states, rows, weight, bias)


@causal_conv1d_indexed.register_fake
def _(x, conv_states, rows, weight, bias):
    return x.new_empty(x.shape)  # (n, 1, channels) contiguous, in x's dtype


OP_NAMES = ("rms_norm", "add_rms_norm", "rms_norm_backward", "silu_and_mul", "silu", "silu_and_mul_backward", "rotary",
            "flash_attention", "flash_attention_backward", "cross_entropy", "fused_linear_cross_entropy",
            "ssd_chunk_scan", "ssd_chunk_scan_backward", "ssm_state_step", "causal_conv1d", "causal_conv1d_backward",
            "ssm_state_step_indexed", "causal_conv1d_indexed")
