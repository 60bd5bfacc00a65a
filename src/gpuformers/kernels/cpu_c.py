"""C kernels for the CPU where torch has no fast op: how they are built and loaded, and the greedy argmax.

    build(name, source, signatures) -> ctypes.CDLL | None     compiled on first use, cached on disk, None without a compiler
    first_argmax(scores (rows, vocab) float32 CPU) -> (rows,) int64 | None

A kernel is C source in a Python string, compiled with the machine's C compiler (`CC`, else gcc, cc or clang: the
one Inductor needs on the CPU anyway) with -O3 -march=native -ffast-math and OpenMP, and cached by the hash of its
source, flags, compiler and CPU flags under $XDG_CACHE_HOME/gpuformers/cpu_kernels (~0.5 s once per machine). The
library links the OpenMP runtime by its soname, so it runs on the one torch has already loaded (one thread pool;
the callers pass torch's thread count). Without a compiler, or when a build fails, `build` returns None with the
reason logged once, and every caller keeps its torch path. GPUFORMERS_CPU_C_KERNELS=0 turns them all off.

The greedy argmax: torch's CPU argmax (and max(-1).indices) reduces element by element: ~1 ms for 48 rows of a 32k
vocabulary on one thread, where amax takes 0.07 ms, which made it 6% of a compiled engine step at a small shape.
This one finds each row's maximum vectorized, then its first position; NaN counts as the maximum (the first NaN's
index), as in torch.

Offers: build, first_argmax, compiler, DISABLE.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
DISABLE = "GPUFORMERS_CPU_C_KERNELS"  # "0": every C kernel off, their torch paths instead


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpuformers" / "cpu_kernels"


def build(name: str, source: str, signatures: dict) -> ctypes.CDLL | None:
    """The library of `source` with each function's (restype, argtypes) from `signatures` set; built once per
    machine and source (-march=native: the CPU's flags are part of the key, for a home folder shared by machines),
    None (the reason logged) where it cannot be built or DISABLE is "0"."""
    if os.environ.get(DISABLE) == "0":
        return None
    cc = compiler()
    if cc is None:
        logger.info("no C compiler found (CC, gcc, cc, clang): the CPU kernel %s is off, its torch path runs", name)
        return None
    digest = hashlib.sha256((source + " ".join(FLAGS) + cc + _cpu_flags()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}_{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                (Path(tmp) / f"{name}.c").write_text(source)
                built = Path(tmp) / target.name
                subprocess.run([cc, *FLAGS, str(Path(tmp) / f"{name}.c"), "-o", str(built), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(built, target)  # atomic: another process building the same file loses nothing
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", "") or error
            logger.warning("could not build the CPU kernel %s with %s (%s): its torch path runs", name, cc,
                           str(detail).strip()[-500:])
            return None
    library = ctypes.CDLL(str(target))
    for function, (restype, argtypes) in signatures.items():
        getattr(library, function).restype = restype
        getattr(library, function).argtypes = argtypes
    return library


ARGMAX_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* x: rows of cols floats, row r at x + r * stride; out[r]: the first index of the row's maximum, or of its first
   NaN. -ffast-math lets the max reduction vectorize; NaNs are found from the bits (integer compares, which
   fast-math leaves alone). */
void argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict row = x + r * stride;
        const uint32_t *restrict bits = (const uint32_t *)row;
        float best = row[0];
        uint32_t nan = 0;
        for (int64_t c = 0; c < cols; c++) {
            best = row[c] > best ? row[c] : best;
            nan |= (bits[c] & 0x7fffffffu) > 0x7f800000u;
        }
        int64_t index = 0;
        if (nan) {
            while ((bits[index] & 0x7fffffffu) <= 0x7f800000u) index++;
        } else {
            while (row[index] != best) index++;
        }
        out[r] = index;
    }
}
"""


@functools.lru_cache(maxsize=1)
def _argmax_library() -> ctypes.CDLL | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return build("argmax", ARGMAX_SOURCE, {"argmax_rows_f32": (None, [p, i64, i64, i64, p, ctypes.c_int])})


def first_argmax(scores: torch.Tensor) -> torch.Tensor | None:
    """(rows, vocab) float32 CPU scores, rows contiguous -> (rows,) int64: argmax's index (the first on ties, NaN
    the maximum); None where the kernel does not serve (other devices or dtypes, no compiler)."""
    if (scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2 or scores.shape[1] == 0
            or scores.stride(1) != 1 or _argmax_library() is None):
        return None
    out = torch.empty(scores.shape[0], dtype=torch.int64)
    _argmax_library().argmax_rows_f32(scores.data_ptr(), scores.shape[0], scores.shape[1], scores.stride(0),
                                      out.data_ptr(), torch.get_num_threads())
    return out
