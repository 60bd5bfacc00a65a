"""The state-space duality (SSD) recurrence of Mamba2 in torch: the chunked scan that prefill runs over a whole
prompt, and the one-token state update that decode runs. Both are the reference (and the CPU path) for the Triton
kernels that `use_kernels=True` may put in their place (marked with use_kernel_function).

Per head h, with a scalar decay per step, the recurrence is

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t (outer) B_t      state: (head_dim, state_size)
    y_t     = state_t @ C_t + D_h * x_t

where dt_t = clamp(softplus(dt_raw_t + dt_bias_h), time_step_limit), and B_t, C_t are shared by the heads of one group.
The chunked scan computes the same thing in blocks of `chunk_size` steps (the SSD paper's block decomposition):

    within a chunk   y_l += sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s     (a quadratic, masked form)
    across chunks    the state at each chunk's start, carried from chunk to chunk; y_l += exp(a_1 + ... + a_l) C_l . start

A prompt that `chunk_size` does not divide is padded at the end with steps that change nothing (decay exp(0) = 1, no
input), so the final state is the state after the last real token. Both functions compute in float32.

ssm_state_step_indexed is the state step of a batch of rows whose states live in a larger pool (the engine's state
slots, engine/state_slots.py), read and written in place at the given rows: here a gather, the step and a scatter;
its Triton kernel reads and writes the pool's rows directly (two passes over the states fewer).

Offers: ssd_chunk_scan, ssm_state_step, ssm_state_step_indexed, softplus_dt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuformers.kernels.mapping import use_kernel_function


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The step sizes: softplus(dt + dt_bias), in dt's dtype (as transformers rounds them in a half-precision model),
    returned in float32. dt (..., heads), dt_bias (heads,)."""
    return F.softplus(dt + dt_bias.to(dt.dtype)).float()


def _repeat_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., groups, state) -> (..., heads, state): head h reads group h // (heads / groups)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a (..., Q) log-decays -> (..., Q, Q) with [l, s] = a_{s+1} + ... + a_l for s <= l and -inf above the
    diagonal (exp gives the causal decay matrix). Summed from the masked steps themselves rather than as a
    difference of two running sums, whose rounding grows with the chunk's total decay."""
    q = a.shape[-1]
    steps = a[..., :, None].expand(*a.shape, q)  # [k, s] = a_k
    below = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)  # k > s
    sums = steps.masked_fill(~below, 0.0).cumsum(dim=-2)  # [l, s] = sum of a_k for s < k <= l
    return sums.masked_fill(~below.logical_or(torch.eye(q, dtype=torch.bool, device=a.device)), float("-inf"))


@use_kernel_function("ssd_chunk_scan")  # use_kernels=True may route this to a Triton kernel
def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, dt_bias: torch.Tensor, chunk_size: int, dt_limit: tuple[float, float],
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan over a sequence (module doc).

    x (batch, seq, heads, head_dim), dt (batch, seq, heads) before its bias, A (heads,) negative, B and C
    (batch, seq, groups, state), D and dt_bias (heads,), initial_state (batch, heads, head_dim, state) or None
    (zeros). Returns y (batch, seq, heads, head_dim) and the final state (batch, heads, head_dim, state), float32.
    """
    batch, seq, heads, head_dim = x.shape
    dt = softplus_dt(dt, dt_bias).clamp(dt_limit[0], dt_limit[1])  # (batch, seq, heads)
    x = x.float()
    B, C = _repeat_groups(B.float(), heads), _repeat_groups(C.float(), heads)  # (batch, seq, heads, state)
    skip = x * D.float()[:, None]  # the D term, on the unscaled input
    x_dt = x * dt[..., None]
    a = dt * A.float()  # (batch, seq, heads): the log-decay of each step

    pad = -seq % chunk_size
    if pad:  # steps of no input and no decay (module doc)
        x_dt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x_dt, B, C))
        a = F.pad(a, (0, 0, 0, pad))
    chunks = (seq + pad) // chunk_size
    # b batch, c chunk, l / s position in the chunk, h head, p head_dim, n state
    x_dt = x_dt.view(batch, chunks, chunk_size, heads, head_dim)
    B = B.view(batch, chunks, chunk_size, heads, -1)
    C = C.view(batch, chunks, chunk_size, heads, -1)
    a = a.view(batch, chunks, chunk_size, heads).permute(0, 3, 1, 2)  # (b, h, c, l)
    a_cum = a.cumsum(dim=-1)  # decay from the chunk's start to l, included

    # within each chunk: attention-like scores C_l . B_s, decayed from s to l, causal
    decay = torch.exp(_segment_sums(a))  # (b, h, c, l, s)
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, x_dt)

    # what each chunk adds to the state by its end: inputs decayed from s to the chunk's last step
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (b, h, c, s)
    added = torch.einsum("bcshn,bhcs,bcshp->bchpn", B, to_end, x_dt)

    # the state at each chunk's start, carried across chunks (a few steps: seq / chunk_size)
    state = (torch.zeros(batch, heads, head_dim, B.shape[-1], dtype=torch.float32, device=x.device)
             if initial_state is None else initial_state.float())
    chunk_decay = torch.exp(a_cum[..., -1])  # (b, h, c): the whole chunk's decay
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = state * chunk_decay[:, :, c, None, None] + added[:, c]
    starts = torch.stack(starts, dim=1)  # (b, c, h, p, n)

    # the start state's part of each output, decayed from the chunk's start to l
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, starts, torch.exp(a_cum))
    y = y.reshape(batch, chunks * chunk_size, heads, head_dim)[:, :seq] + skip
    return y, state


@use_kernel_function("ssm_state_step")  # use_kernels=True may route this to a Triton kernel
def ssm_state_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the recurrence (module doc): state (batch, heads, head_dim, state), x (batch, heads,
    head_dim), dt (batch, heads) before its bias, B and C (batch, groups, state). Returns y (batch, heads, head_dim)
    and the new state, float32.

    No time_step_limit here: transformers' (and mamba_ssm's) decode step applies softplus without the clamp that
    their chunked scan applies, and greedy tokens must match theirs. With the default limit (0, inf) the two agree."""
    heads = x.shape[1]
    dt = softplus_dt(dt, dt_bias)  # (batch, heads)
    x = x.float()
    B, C = _repeat_groups(B.float(), heads), _repeat_groups(C.float(), heads)  # (batch, heads, state)
    decay = torch.exp(dt * A.float())[..., None, None]  # (batch, heads, 1, 1)
    state = state.float() * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C) + x * D.float()[:, None]
    return y, state


@use_kernel_function("ssm_state_step_indexed")  # use_kernels=True may route this to a Triton kernel
def ssm_state_step_indexed(states: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                           dt_bias: torch.Tensor) -> torch.Tensor:
    """ssm_state_step for n rows whose states are rows `rows` of a pool, updated in place: states (pool rows, heads,
    head_dim, state) float32, rows (n,) int, the others as ssm_state_step's with batch n. Returns y (n, heads,
    head_dim) float32. A row index listed twice (the engine's CUDA-graph padding rows, which all use one scratch
    row) leaves that row holding one of its updates."""
    y, new = ssm_state_step(states.index_select(0, rows), x, dt, A, B, C, D, dt_bias)
    states.index_copy_(0, rows, new)
    return y
