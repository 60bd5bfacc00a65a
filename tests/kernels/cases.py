"""Shared cases for the kernel tests: (device, dtype) parameters with their marks, tolerances, random inputs.

tests/kernels/conftest.py has already set TRITON_INTERPRET=1 on machines without a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gpuformers.kernels.checks import interpreter_on  # noqa: E402

CUDA = torch.cuda.is_available()
_needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")]
_needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="CPU cases need TRITON_INTERPRET=1")

# (device, dtype) cases: float32 and float16 everywhere, bfloat16 on the GPU only (the interpreter gets it wrong).
CASES = [
    pytest.param("cpu", torch.float32, marks=_needs_interpreter, id="cpu-float32"),
    pytest.param("cpu", torch.float16, marks=_needs_interpreter, id="cpu-float16"),
    pytest.param("cuda", torch.float32, marks=_needs_cuda, id="cuda-float32"),
    pytest.param("cuda", torch.float16, marks=_needs_cuda, id="cuda-float16"),
    pytest.param("cuda", torch.bfloat16, marks=_needs_cuda, id="cuda-bfloat16"),
]
DEVICES = [pytest.param("cpu", marks=_needs_interpreter, id="cpu"), pytest.param("cuda", marks=_needs_cuda, id="cuda")]

# Tolerances against the float32 torch reference: float32 is tight (the acceptance bar is 1e-4 relative).
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(actual, expected, dtype, scale: float = 1.0):
    tol = TOL[dtype] * scale
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def rand(*shape, device="cpu", dtype=torch.float32, grad=False, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    t = torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)
