"""MXFP4 dequantizing (quantization/mxfp4.py) without host data: the torch path runs for every expert of a training
forward (the Triton kernel has no autograd), so a tensor copied from a Python list there would make each call wait
for the GPU. The kernel itself is tested in tests/kernels/test_mxfp4_matmul.py."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gpuformers.kernels.packed_formats import E2M1_VALUES, dequantize_mxfp4
from gpuformers.quantization.mxfp4 import mxfp4_linear


class _RecordCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _packed(rows=4, groups=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, groups, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 135, (rows, groups), dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_dequantize_copies_nothing_from_the_host():
    blocks, scales = _packed()
    with _RecordCalls() as record:
        values = dequantize_mxfp4(blocks, scales, torch.float32)
    assert not {torch.tensor, torch.as_tensor, torch.from_numpy} & set(record.calls)
    # the values are the E2M1 table's, signed zeros included, times 2^(scale - 127)
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)
    expected = (torch.tensor(E2M1_VALUES)[codes.long()] * torch.exp2(scales.float() - 127)[..., None]).flatten(-2)
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_forward_on_the_gpu_does_not_synchronize():
    blocks, scales = (t.cuda() for t in _packed(64, 4))
    x = torch.randn(3, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # the torch path (autograd)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mxfp4_linear(x, blocks, scales)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.testing.assert_close(out, x @ dequantize_mxfp4(blocks, scales, torch.bfloat16).T)
