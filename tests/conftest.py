"""Without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1), which must be switched on before
triton is first imported: here, before any test module is collected, so that any subset of the tests (the model
families' use_kernels tests, the quantization tests, ...) runs as the whole suite does. Kernel tests then run on
the CPU under the interpreter, and on a GPU when one is present (tests marked `gpu`, run by scripts/gpu_check.sh);
the interpreter computes bfloat16 `tl.dot` wrongly, so bfloat16 kernel cases run on the GPU only."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
