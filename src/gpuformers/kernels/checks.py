"""What every kernel launcher checks before it starts a Triton program, and whether Triton can run at all.

Triton kernels run on NVIDIA GPUs, and on the CPU only under its interpreter (`TRITON_INTERPRET=1`, set before
triton is imported), which is how the tests run them. bfloat16 is computed wrongly by the interpreter's `tl.dot`,
so bfloat16 is tested on the GPU only.

Offers: triton_importable, interpreter_on, triton_runs_on, check_tensor, check_same, check_rows, next_power_of_2,
dot_precision, leave_to_torch.
"""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(device: torch.device | str) -> tuple[bool, str]:
    """(True, "") when a Triton kernel can run on `device`, else (False, the reason in words)."""
    device = torch.device(device)
    if not triton_importable():
        return False, "triton is not installed (pip install 'gpuformers[kernels]')"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu":
        if interpreter_on():
            return True, ""
        return False, "the model is on the CPU and TRITON_INTERPRET=1 is not set (the kernels are for NVIDIA GPUs)"
    return False, f"Triton kernels do not run on {device.type} devices"


def check_tensor(name: str, tensor: torch.Tensor, *, ndim: int | None = None, dtypes=FLOAT_DTYPES,
                 last_dim_contiguous: bool = True) -> None:
    """Raise a ValueError that names `name` when the tensor has the wrong rank, dtype or innermost stride."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(tensor.dtype).replace('torch.', '')}, which is not one of: {names}")
    if last_dim_contiguous and tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride {tensor.stride(-1)}); call .contiguous() first"
        )
    if torch.compiler.is_compiling():
        return  # tracing: whether Triton runs on this device was settled when the model was kernelized
    runs, why = triton_runs_on(tensor.device)
    if not runs:
        raise RuntimeError(f"cannot run a Triton kernel on {name}: {why}")


def check_same(what: str, **tensors: torch.Tensor) -> None:
    """All tensors share device (and dtype when what == "dtype")."""
    values = {name: (t.device if what == "device" else t.dtype) for name, t in tensors.items()}
    if len(set(values.values())) > 1:
        listed = ", ".join(f"{name}: {value}" for name, value in values.items())
        raise ValueError(f"these tensors must share one {what}, got {listed}")


def check_rows(rows: torch.Tensor, count: int) -> None:
    """An index of `count` rows of a pool of states (the engine's state slots), as the indexed kernels read it: a
    1-d int32 or int64 tensor. (The kernels do not check the values: a row outside the pool is out of bounds.)"""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        shown = (f"{rows.dtype} of shape {tuple(rows.shape)}" if isinstance(rows, torch.Tensor)
                 else type(rows).__name__)
        raise ValueError(f"rows must be a 1-d int32 or int64 tensor of pool rows, got {shown}")
    if rows.shape[0] != count:
        raise ValueError(f"rows has {rows.shape[0]} entries, expected one per input row ({count})")


def check_bias_and_devices(bias: torch.Tensor | None, out_features: int, **tensors: torch.Tensor) -> None:
    """A matmul launcher's last checks: the bias (None, or one value per output feature) and every tensor on one
    device."""
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != out_features:
            raise ValueError(f"bias has {bias.shape[0]} entries, expected out_features={out_features}")
        tensors["bias"] = bias
    check_same("device", **tensors)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would silently use TF32 on Ampere+ (about 1e-3 relative error); the reference is exact.
    return "ieee" if dtype == torch.float32 else "tf32"


def leave_to_torch(*tensors) -> bool:
    """Whether a forward-only kernel function must hand this call back to its torch function (return
    NotImplemented): autograd would need a gradient through it. (Read while torch.compile traces too.)"""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
