"""The MXFP4 matmul kernel (gpt-oss's packed experts) against F.linear on the dequantized weight: every E2M1 code and a
range of E8M0 scales decoded exactly, bias or not, edges of M and N, split-K, clear errors; GPU cases run bfloat16 at
gpt-oss's sizes."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import CASES, CUDA, assert_close

from gpuformers.kernels.mxfp4_matmul import mxfp4_matmul_forward, mxfp4_matmul_reference  # noqa: E402
from gpuformers.kernels.weight_only_matmul import MatmulConfig  # noqa: E402
from gpuformers.kernels.packed_formats import E2M1_VALUES, dequantize_mxfp4  # noqa: E402


def _weights(n: int, k: int, device="cpu", seed=0, scale_range=(122, 131)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(*scale_range, (n, k // 32), generator=g, dtype=torch.uint8)
    return blocks.to(device), scales.to(device)


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 48, 96), (33, 80, 128), (70, 16, 32)])
def test_matches_dequantize_then_linear(device, dtype, m, n, k):
    blocks, scales = _weights(n, k, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    for b in (None, bias):
        expected = mxfp4_matmul_reference(x.float(), blocks, scales, None if b is None else b.float())
        out = mxfp4_matmul_forward(x, blocks, scales, b)
        assert out.dtype == dtype and out.shape == (m, n)
        assert_close(out, expected, dtype, scale=expected.abs().max().item())


@pytest.mark.parametrize("device, dtype", CASES[:1] + CASES[2:3])  # float32, CPU and GPU
def test_every_code_and_scale_decodes_exactly(device, dtype):
    """x = I reads W back row by row: each of the 16 E2M1 codes at scales 2^-10 .. 2^5 equals the table's value."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # one block of 32 values: every code twice
    blocks = (codes[0::2] | (codes[1::2] << 4)).view(1, 1, 16).repeat(16, 1, 1)  # (16 rows, 1 block, 16 bytes)
    scales = torch.arange(117, 133, dtype=torch.uint8).view(16, 1)  # row r scaled by 2^(r - 10)
    out = mxfp4_matmul_forward(torch.eye(32, device=device, dtype=dtype), blocks.to(device), scales.to(device),
                               config=MatmulConfig(16, 16, 32))
    table = torch.tensor(E2M1_VALUES).repeat(2)
    expected = table[None, :] * torch.exp2(torch.arange(-10, 6, dtype=torch.float32))[:, None]  # (16 rows, 32)
    assert torch.equal(out.T.float().cpu(), expected)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).view(16, 32), expected)


@pytest.mark.parametrize("device, dtype", CASES[:1])
def test_split_k_and_three_dimensional_inputs(device, dtype):
    blocks, scales = _weights(32, 256, device)
    x = torch.randn(2, 3, 256).to(device, dtype)
    expected = mxfp4_matmul_reference(x, blocks, scales)
    for config in (MatmulConfig(16, 16, 32, split_k=4), MatmulConfig(16, 32, 16)):
        assert_close(mxfp4_matmul_forward(x, blocks, scales, config=config), expected, dtype,
                     scale=expected.abs().max().item())


@pytest.mark.parametrize("device, dtype", CASES[:1])
def test_clear_errors(device, dtype):
    blocks, scales = _weights(16, 64, device)
    x = torch.randn(3, 64).to(device, dtype)
    with pytest.raises(ValueError, match=r"blocks has shape \(16, 2, 16\), but x has 96 features"):
        mxfp4_matmul_forward(torch.randn(3, 96).to(device, dtype), blocks, scales)
    with pytest.raises(ValueError, match=r"scales has shape \(16, 1\), expected \(16, 2\)"):
        mxfp4_matmul_forward(x, blocks, scales[:, :1])
    with pytest.raises(ValueError, match="blocks has dtype int8"):
        mxfp4_matmul_forward(x, blocks.view(torch.int8), scales)
    with pytest.raises(ValueError, match="bias has 8 entries, expected out_features=16"):
        mxfp4_matmul_forward(x, blocks, scales, torch.zeros(8).to(device, dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 4, 64, 300])
def test_gpu_bfloat16_at_gpt_oss_sizes(rows):
    blocks, scales = _weights(5760, 2880, "cuda")  # gpt-oss's gate_up_proj of one expert
    x = torch.randn(rows, 2880, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(5760, device="cuda", dtype=torch.bfloat16)
    out = mxfp4_matmul_forward(x, blocks, scales, bias)
    ref = mxfp4_matmul_reference(x.float(), blocks, scales, bias.float())
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=1e-2 * ref.abs().max().item())
