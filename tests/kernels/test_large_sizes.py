"""What only real sizes reach, shown at tiny ones: int32 offsets past 2**31, and CUDA's limits on grid axes.

Offsets: the tensor under test has its rows (heads, batch entries) 2**30 or 2**27 elements apart inside one large
buffer, so that a row's offset, `row * stride`, passes 2**31 as it would in a tensor of 2**31 elements. torch.empty
maps the buffer's pages without touching them, so only the few rows written become memory (the interpreter hands
CPU tensors to the kernel without copying them), and the interpreter wraps int32 arithmetic as a GPU does. The view
starts 2**31 elements into its buffer, so a wrapped offset still points inside it: the kernel reads a wrong row
instead of crashing. CPU only: on a GPU the buffer would be real memory.

Grids: the kernels are replaced by a recorder, so a launch of 70,000 programs costs nothing.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import DEVICES, assert_close, rand

from gpuformers.kernels import attention  # noqa: E402  (after the triton skip)
from gpuformers.kernels.checks import interpreter_on  # noqa: E402
from gpuformers.kernels.rms_norm import rms_norm_backward, rms_norm_forward, rms_norm_reference  # noqa: E402
from gpuformers.kernels.rotary import rotary_forward  # noqa: E402
from gpuformers.layers.rotary import apply_rotary_pos_emb  # noqa: E402

rotary_reference = apply_rotary_pos_emb.torch_function  # the torch computation the kernel replaces

_START = 2**31  # where the view begins in its buffer
_CUDA_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="reads a sparse 8 GiB CPU buffer")


def _spread(values: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """A copy of `values` laid out with these (huge) strides, 2**31 elements into an untouched buffer."""
    span = sum((n - 1) * s for n, s in zip(values.shape, strides)) + 1
    try:
        buffer = torch.empty(_START + span, dtype=values.dtype)
    except RuntimeError as e:  # strict overcommit (vm.overcommit_memory=2) refuses the address space
        pytest.skip(f"cannot reserve {(_START + span) * values.element_size() / 2**30:.0f} GiB of address space: {e}")
    view = buffer.as_strided(values.shape, strides, _START)
    view.copy_(values)
    return view


@needs_interpreter
def test_rms_norm_backward_rows_past_int32():
    # Rows 2**30 elements apart: row 2 starts at 2**31. Forward and backward must both read it.
    dense = rand(3, 64, dtype=torch.float16, seed=0)
    x = _spread(dense, (2**30, 1))
    w = 1 + 0.1 * rand(64, dtype=torch.float16, seed=1)
    dy = rand(3, 64, dtype=torch.float16, seed=2)
    y, _, rstd = rms_norm_forward(x, w, 1e-6)
    dx, dw = rms_norm_backward(dy, x, w, rstd)
    x_ref, w_ref = dense.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y_ref = rms_norm_reference(x_ref, w_ref, 1e-6)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), dy)
    assert_close(y, y_ref, torch.float16)
    assert_close(dx, dx_ref, torch.float16, scale=4)
    assert_close(dw, dw_ref, torch.float16, scale=4)


@needs_interpreter
def test_rotary_heads_past_int32():
    # x (batch, heads, seq, head_dim) with heads 2**30 elements apart: head 2 starts at 2**31.
    dense = rand(1, 3, 2, 16, dtype=torch.float16, seed=0)
    x = _spread(dense, (3 * 2**30, 2**30, 16, 1))
    angles = rand(1, 2, 8, seed=1).repeat(1, 1, 2)
    cos, sin = angles.cos().half(), angles.sin().half()
    want, _ = rotary_reference(dense, dense, cos, sin)
    assert_close(rotary_forward(x, cos, sin), want, torch.float16)


@needs_interpreter
def test_attention_batch_past_int32():
    # q (batch, heads, q_len, head_dim) with batch entries 2**30 elements apart: batch 2 starts at 2**31.
    dense = rand(3, 1, 16, 16, dtype=torch.float16, seed=0)
    q = _spread(dense, (2**30, 256, 16, 1))
    k, v = rand(3, 1, 16, 16, dtype=torch.float16, seed=1), rand(3, 1, 16, 16, dtype=torch.float16, seed=2)
    out = attention.flash_attention(q, k, v, causal=True)
    assert_close(out, attention.attention_reference(dense, k, v, causal=True), torch.float16)


@needs_interpreter
def test_attention_mask_rows_past_int32():
    # A (1, 1, q_len, kv_len) mask with rows 2**27 bytes apart: row 16 starts at 2**31 (a 46k x 46k mask's size).
    torch.manual_seed(0)
    allowed = torch.rand(1, 1, 17, 16) < 0.5
    allowed[..., 0] = True  # every query sees a key: no all-zero rows that a wrong read could match
    mask = _spread(allowed, (17 * 2**27, 17 * 2**27, 2**27, 1))
    q = rand(1, 1, 17, 16, dtype=torch.float16, seed=1)
    k, v = rand(1, 1, 16, 16, dtype=torch.float16, seed=2), rand(1, 1, 16, 16, dtype=torch.float16, seed=3)
    out = attention.flash_attention(q, k, v, causal=False, mask=mask)
    assert_close(out, attention.attention_reference(q, k, v, causal=False, mask=allowed), torch.float16)


class _Launches:
    """Stands in for a Triton kernel: records the grid of each launch and runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("device", DEVICES)
def test_attention_grid_fits_cuda_limits(device, monkeypatch):
    # 1,100 packed one-token sequences of 64 query heads: batch * heads (70,400) on one grid axis would pass the
    # 65,535 that CUDA allows on axes 1 and 2, and the launch would fail.
    kernels = ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel")
    launches = {name: _Launches() for name in kernels}
    for name, fake in launches.items():
        monkeypatch.setattr(attention, name, fake)
    seqs, heads, kv_heads = 1100, 64, 8
    q = torch.zeros(seqs, heads, 16, device=device, requires_grad=True)
    k = torch.zeros(seqs, kv_heads, 16, device=device, requires_grad=True)
    v = torch.zeros(seqs, kv_heads, 16, device=device, requires_grad=True)
    cu = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    out = attention.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=1)
    out.float().sum().backward()
    for name, fake in launches.items():
        assert len(fake.grids) == 1, name
        grid = fake.grids[0]
        assert grid[0] < 2**31 and all(n <= _CUDA_GRID_YZ for n in grid[1:]), f"{name} grid {grid}"
    too_many = torch.arange(70_001, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="70000 sequences of 1 heads"):
        attention.flash_attention(*(torch.zeros(70_000, 1, 16, device=device) for _ in range(3)),
                                  cu_seqlens_q=too_many, cu_seqlens_k=too_many, max_seqlen_q=1, max_seqlen_k=1)
