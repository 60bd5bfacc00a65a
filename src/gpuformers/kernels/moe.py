"""Fused mixture-of-experts forward for inference (Qwen3-MoE's SparseMoeBlock): two grouped Triton GEMMs over
tokens grouped by expert, beside a torch reference.

    assignments  a = t * top_k + k            (tokens, top_k) router choices, flattened: N = tokens * top_k
    align        sort a by expert; pad each expert's run to BLOCK_M rows (sentinel N) -> sorted_ids (P,),
                 block_expert (P / BLOCK_M,): the one expert of each row block, -1 past the end
    gemm 1       act[a]  = silu(x[t] @ W_gate[e]^T) * (x[t] @ W_up[e]^T)          (N, intermediate)
    gemm 2       y[a]    = (act[a] @ W_down[e]^T) * router_weight[a]                  (N, hidden)
    sum          out[t]  = sum over k of y[t * top_k + k]                             (tokens, hidden)

        sorted_ids:  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- | -- ...     (BLOCK_M = 4, -- = N)
        programs:      block 0: W[e0]  block 1: W[e2]  block 2: W[e2]  block 3: W[e5]  block 4: exits

Each program of a GEMM takes one block of BLOCK_M assignments (all of one expert) and BLOCK_N output columns,
gathers its token rows of x (gemm 1) or act (gemm 2) and multiplies them by that expert's weight tile, so every
expert's weights are read once per row block however the tokens are spread. The alignment is torch code with no
host sync (the grid size depends only on the shapes), so decode steps can be captured in a CUDA graph. Rounding
follows the torch block: gate, up, silu(gate), the product, down_proj and the router product are each rounded to
the model dtype, in float32 in between.

Weights: the kernels want each projection of all experts in one (experts, out, in) tensor, and the checkpoint
keeps them in separate nn.Linear modules (experts.{e}.{gate,up,down}_proj.weight). stacked_expert_weights copies
them once into one buffer laid out as

    [ gate_0; up_0 | gate_1; up_1 | ... ]  (experts, 2 * intermediate, hidden)   then
    [ down_0 | down_1 | ... ]              (experts, hidden, intermediate)

and points each expert Parameter's .data at its slice, so the stack costs no memory beyond a transient copy of
one block's experts while it is built (about 1.2 GB per layer for Qwen3-30B-A3B in bfloat16; keeping separate
stacked copies instead would double the experts' memory, about 58 GB more for that model). The Parameters stay
the same objects: state_dict, saving (slices at distinct offsets are distinct tensors to save.py), optimizers,
in-place loads and the torch path see the same numbers. Each forward checks in O(1) that the weights still lie
in that buffer (the first and the last expert's Linears and weights); anything that gives them new storage
(model.to(dtype or device), load_state_dict(assign=True), device_map streaming an offloaded layer in: a copy of
the block's experts each forward there) makes the next forward stack them again. Replacing a middle expert's
Parameter or Linear by hand after the first kernel forward is not seen: copy into the weight (`weight.copy_(...)`)
or call `unstack_expert_weights(block)` afterwards. Experts that are not plain nn.Linear layers without bias
(quantized, LoRA-wrapped, tensor-parallel shards) keep the torch forward, with a warning.

Training: no backward is written. The layer kernel's training forward is the torch block (mapping.py), and the
inference forward also runs the torch block whenever autograd would need a gradient (grad enabled and the input
or a weight requiring one). Under torch.compile the grouped GEMMs run as the op gpuformers::fused_moe (registered
here) and finding the stacked weights is left out of the graph (one graph break per MoE block).

Offers: fused_moe, fused_moe_reference, align_by_expert, stacked_expert_weights, unstack_expert_weights,
sparse_moe_forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.library import custom_op

from gpuformers.kernels.checks import check_same, check_tensor, dot_precision, next_power_of_2
from gpuformers.kernels.mapping import warn_once

# --- kernels ------------------------------------------------------------------------------------------------

@triton.jit
def _gate_up_kernel(X, W, ACT, SORTED_IDS, BLOCK_EXPERT, num_assignments, top_k, hidden, intermediate,
                    stride_x, stride_we, stride_wn, stride_act,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block).to(tl.int64)
    if expert < 0:  # a padding block past the last expert's run
        return
    assignment = tl.load(SORTED_IDS + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    valid = assignment < num_assignments
    token = (assignment // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate columns
    col_ok = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + token[:, None] * stride_x + ks[None, :]  # (BLOCK_M, BLOCK_K)
    # W[e] is (2 * intermediate, hidden): gate rows first, then up rows; tiles are read as (BLOCK_K, BLOCK_N)
    gate_ptrs = W + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + intermediate * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + ks) < hidden
        x = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), gate, input_precision=PRECISION)
        up = tl.dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = ACT.dtype.element_ty
    # Rounded where the torch block rounds: each projection, silu(gate), the product.
    gate = gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    act_ptrs = ACT + assignment[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(act_ptrs, act.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(ACT, W, ROUTER_WEIGHTS, Y, SORTED_IDS, BLOCK_EXPERT, num_assignments, hidden, intermediate,
                 stride_act, stride_we, stride_wn, stride_y,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block).to(tl.int64)
    if expert < 0:
        return
    assignment = tl.load(SORTED_IDS + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = assignment < num_assignments
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    act_ptrs = ACT + assignment[:, None] * stride_act + ks[None, :]
    w_ptrs = W + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # W[e]: (hidden, inter)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, intermediate, BLOCK_K):
        k_ok = (k0 + ks) < intermediate
        a = tl.load(act_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        act_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = Y.dtype.element_ty
    weight = tl.load(ROUTER_WEIGHTS + assignment, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]  # down_proj rounded, then the router weight
    tl.store(Y + assignment[:, None] * stride_y + cols[None, :], y.to(dtype), mask=valid[:, None] & col_ok[None, :])


# --- alignment and launch -----------------------------------------------------------------------------------

def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, top_k) expert ids -> sorted_ids (P,) int32 and block_expert (P / block_m,) int32.

    sorted_ids lists the assignments (t * top_k + k) by expert, each expert's run padded to a multiple of block_m
    with the sentinel tokens * top_k; block_expert is the expert of each block of block_m rows, -1 for blocks past
    the last run. P = N + min(experts, N) * (block_m - 1) rounded up to block_m bounds the padded length from the
    shapes alone, so nothing waits on the GPU.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    device = flat.device
    used_bound = n + min(num_experts, n) * (block_m - 1)
    padded_len = triton.cdiv(used_bound, block_m) * block_m
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, in token order within one
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    expert_of_sorted = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    sorted_ids = torch.full((padded_len,), n, dtype=torch.int32, device=device)
    sorted_ids[(padded_end - padded)[expert_of_sorted] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, padded_len, block_m, device=device)
    # Runs are multiples of block_m, so a block lies in one run: the first run ending after its start.
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _tile(n: int, largest: int) -> int:
    # tl.dot needs every tile side >= 16
    return max(16, min(largest, next_power_of_2(n)))


def _block_m(num_assignments: int, num_experts: int) -> int:
    # Rows per block ~ assignments per expert: small for decode (less padding), larger for prefill (fewer re-reads
    # of each weight tile).
    per_expert = num_assignments / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def _check(x, w13, w2, topk_weights, topk_ids):
    check_tensor("hidden_states", x, ndim=2)
    check_tensor("w13", w13, ndim=3)
    check_tensor("w2", w2, ndim=3)
    check_tensor("topk_weights", topk_weights, ndim=2)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    check_same("dtype", hidden_states=x, w13=w13, w2=w2)
    check_same("device", hidden_states=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or two_inter % 2 or tuple(w2.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"hidden_states {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be "
                         "(tokens, hidden), (experts, 2 * intermediate, hidden) and (experts, hidden, intermediate)")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must both "
                         f"be (tokens, top_k) with tokens = {x.shape[0]}, as hidden_states")
    if not (w13.stride(1) == hidden and w2.stride(1) == w2.shape[2]):
        raise ValueError("w13 and w2 must be contiguous within each expert; call .contiguous() first")


def fused_moe_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """The launcher: x (tokens, hidden) -> (tokens, hidden); see fused_moe."""
    _check(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    intermediate, top_k = two_inter // 2, topk_ids.shape[1]
    n = tokens * top_k
    if n == 0 or hidden == 0:
        return torch.zeros_like(x)
    block_m = _block_m(n, experts)
    sorted_ids, block_expert = align_by_expert(topk_ids, experts, block_m)
    act = torch.empty(n, intermediate, dtype=x.dtype, device=x.device)  # (N, intermediate), row a = assignment a
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)  # (N, hidden)
    precision = dot_precision(x.dtype)
    # Decode-sized blocks read weights and little else: narrower column tiles give more programs to stream them.
    widest = 32 if block_m == 16 else 64
    block_n, block_k = _tile(intermediate, widest), _tile(hidden, 64)
    blocks = block_expert.numel()
    _gate_up_kernel[(blocks, triton.cdiv(intermediate, block_n))](
        x, w13, act, sorted_ids, block_expert, n, top_k, hidden, intermediate,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    block_n, block_k = _tile(hidden, widest), _tile(intermediate, 64)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, w2, topk_weights.reshape(-1).contiguous(), y, sorted_ids, block_expert, n, hidden, intermediate,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y.view(tokens, top_k, hidden).sum(dim=1)


@custom_op("gpuformers::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    return fused_moe_forward(x, w13, w2, topk_weights, topk_ids)


@_fused_moe_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Triton MoE experts, no autograd: x (tokens, hidden), w13 (experts, 2 * intermediate, hidden) = gate rows then
    up rows, w2 (experts, hidden, intermediate), topk_weights / topk_ids (tokens, top_k) -> (tokens, hidden)."""
    if torch.compiler.is_compiling():  # the torch.library op: torch.compile keeps it in its graph
        return _fused_moe_op(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_forward(x, w13, w2, topk_weights, topk_ids)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The same experts in torch, one expert after the other, as SparseMoeBlock computes them."""
    intermediate = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate_up = F.linear(x[token], w13[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = F.linear(act, w2[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


# --- the expert weights as stacked tensors ------------------------------------------------------------------

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _plain_linear(module: nn.Module) -> bool:
    # exactly nn.Linear (not a quantized or LoRA subclass or wrapper), no bias, a plain tensor (not a DTensor shard)
    return type(module) is nn.Linear and module.bias is None and type(module.weight.data) is torch.Tensor


def _projections(block: nn.Module, expert: int) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter] | None:
    """The gate, up and down weights of one expert, or None when they are not all plain nn.Linear weights."""
    mlp = block.experts[expert]
    linears = [getattr(mlp, name, None) for name in _PROJECTIONS]
    return tuple(linear.weight for linear in linears) if all(_plain_linear(m) for m in linears) else None


def _views(weight: torch.Tensor, experts: int, intermediate: int, hidden: int):
    # (experts, 2 * intermediate, hidden) and (experts, hidden, intermediate) over the storage `weight` lies in
    w13 = weight.detach().as_strided((experts, 2 * intermediate, hidden), (2 * intermediate * hidden, hidden, 1), 0)
    w2 = weight.detach().as_strided((experts, hidden, intermediate), (hidden * intermediate, intermediate, 1),
                                    experts * 2 * intermediate * hidden)
    return w13, w2


def _still_stacked(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stacked views when the expert weights still lie in the buffer stacked_expert_weights made, else None."""
    experts = len(block.experts)
    first, last = _projections(block, 0), _projections(block, experts - 1)
    if first is None or last is None:
        return None
    (gate, up, _), down = first, last[2]
    intermediate, hidden = gate.shape
    size = gate.element_size()
    base = gate.untyped_storage().data_ptr()
    if (gate.storage_offset() != 0 or up.shape != gate.shape or down.shape != (hidden, intermediate)
            or up.dtype != gate.dtype or down.dtype != gate.dtype
            or gate.untyped_storage().nbytes() != experts * 3 * intermediate * hidden * size
            or up.data_ptr() != base + intermediate * hidden * size
            or down.data_ptr() != base + (experts * 2 + experts - 1) * intermediate * hidden * size):
        return None
    return _views(gate, experts, intermediate, hidden)


def _stackable(block: nn.Module) -> str:
    """Why the experts cannot share one buffer, or "" when they can."""
    first = None
    for e, mlp in enumerate(block.experts):
        for name in _PROJECTIONS:
            linear = getattr(mlp, name, None)
            if not _plain_linear(linear):
                return f"experts.{e}.{name} is a {type(linear).__name__}, not an nn.Linear without bias"
            weight = linear.weight
            first = weight if first is None else first
            expected = tuple(first.shape[::-1]) if name == "down_proj" else tuple(first.shape)
            if weight.device.type == "meta" or tuple(weight.shape) != expected:
                return (f"experts.{e}.{name}.weight has shape {tuple(weight.shape)} on {weight.device}; expected "
                        f"{expected}, as expert 0's gate_proj, on a real device")
            if weight.dtype != first.dtype or weight.device != first.device:
                return (f"experts.{e}.{name}.weight is {weight.dtype} on {weight.device}, expert 0's gate_proj is "
                        f"{first.dtype} on {first.device}")
    return ""


def stacked_expert_weights(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(w13 (experts, 2 * intermediate, hidden), w2 (experts, hidden, intermediate)) of a SparseMoeBlock, sharing
    storage with its expert Parameters (stacked into one buffer on the first call; see the module docstring), or
    None when the experts cannot be stacked (the reason is logged)."""
    stacked = _still_stacked(block)
    if stacked is not None:
        return stacked
    why = _stackable(block)
    if why:
        warn_once(f"SparseMoeBlock keeps its torch forward: {why}")
        return None
    experts = len(block.experts)
    gate = _projections(block, 0)[0]
    intermediate, hidden = gate.shape
    # A normal tensor even when the first kernel forward runs under inference_mode: training may follow.
    with torch.inference_mode(False), torch.no_grad():
        buffer = torch.empty(experts * 3 * intermediate * hidden, dtype=gate.dtype, device=gate.device)
        w13, w2 = _views(buffer, experts, intermediate, hidden)
        for e in range(experts):
            gate_w, up_w, down_w = _projections(block, e)
            for param, view in ((gate_w, w13[e, :intermediate]), (up_w, w13[e, intermediate:]), (down_w, w2[e])):
                view.copy_(param)
                param.data = view  # the same Parameter object, now a slice of the buffer
    return _still_stacked(block)


def unstack_expert_weights(block: nn.Module) -> None:
    """Give every expert weight its own storage again (a copy each), so that the next kernel forward stacks the
    weights as they are now: call it after replacing some expert's Parameter or Linear by hand."""
    with torch.inference_mode(False), torch.no_grad():
        for e in range(len(block.experts)):
            for param in _projections(block, e) or ():
                param.data = param.data.clone()


@torch.compiler.disable  # reads storage pointers; runs outside the compiled graph
def _stacked_or_none(block: nn.Module):
    return stacked_expert_weights(block)


def _needs_grad(block: nn.Module, x: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    # The first expert stands for all: requires_grad is set model-wide, or by adapters that wrap the Linears
    # (which take the torch path anyway).
    first = _projections(block, 0) or ()
    return x.requires_grad or block.gate.weight.requires_grad or any(p.requires_grad for p in first)


def sparse_moe_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """SparseMoeBlock.forward with the experts as fused Triton kernels (self is the block)."""
    stacked = None if _needs_grad(self, hidden_states) else _stacked_or_none(self)
    if stacked is None:
        return type(self).forward(self, hidden_states)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    _, weights, experts = self.gate(x)
    return fused_moe(x, stacked[0], stacked[1], weights, experts).view(shape)
