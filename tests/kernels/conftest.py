"""Kernel tests run the Triton kernels on the CPU under the interpreter (TRITON_INTERPRET=1, set here before triton is
imported), and on a GPU when one is present (tests marked `gpu`, run by scripts/gpu_check.sh).

The interpreter computes bfloat16 `tl.dot` wrongly, so bfloat16 cases run on the GPU only.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
