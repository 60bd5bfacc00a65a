"""Q8_0, Q4_0 and Q4_1 dequantized with torch (loading/gguf_dequant.py) give the gguf package's numbers bit for bit;
other types are left to the package."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuformers.loading.gguf_dequant import TORCH_BLOCK_TYPES, dequantize_blocks


@pytest.mark.parametrize("type_name", sorted(TORCH_BLOCK_TYPES))
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (130, 576)])
def test_blocks_equal_the_gguf_package(type_name, shape):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(sum(shape))
    # rows of very different scales, a row of zeros, and values around the 4-bit steps
    weights = (rng.standard_normal(shape) * rng.uniform(1e-3, 5.0, (shape[0], 1))).astype(np.float32)
    weights[0, : min(32, shape[1])] = 0.0
    qtype = getattr(GGMLQuantizationType, type_name)
    blocks = quantize(weights, qtype)  # (rows, row bytes) uint8
    expected = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, qtype), dtype=np.float32))
    got = dequantize_blocks(blocks, type_name)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, expected)


def test_other_types_are_left_to_the_gguf_package():
    assert dequantize_blocks(np.zeros((2, 144), dtype=np.uint8), "Q4_K") is None
