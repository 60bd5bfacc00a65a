#!/usr/bin/env bash
# The one prepared GPU check: every `gpu`-marked test, then the kernel benchmark table (--quick), with all output
# written under $OUT. Run from the repository root of a checkout where torch, triton, transformers, peft and
# safetensors are already installed; it never installs anything and needs no network.
#
#   OUT=/tmp/gpu-results PYTHONPATH=src scripts/gpu_check.sh
#
# Files written under $OUT: env.txt (GPU, driver, versions), pytest_gpu.txt (+ junit xml), bench_kernels.txt and
# bench_kernels.json. The two steps are time-boxed (5.5 and 3.5 minutes) so the whole call fits in 10 minutes.
# Exit status: 0 when both steps passed, else the first failing step's status.
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
OUT="${OUT:-${repo_root}/out/gpu_check}"
mkdir -p "${OUT}"
export PYTHONPATH="${repo_root}/src${PYTHONPATH:+:${PYTHONPATH}}"
unset TRITON_INTERPRET  # real kernels on the GPU, never the interpreter
export PYTHONDONTWRITEBYTECODE=1

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("triton", "transformers", "flash_attn", "peft"):
    try:
        print(name, __import__(name).__version__)
    except Exception as err:
        print(name, "not available:", type(err).__name__)
PY
} > "${OUT}/env.txt" 2>&1
cat "${OUT}/env.txt"

status=0
echo "== pytest -m gpu"
timeout 330 python -m pytest -m gpu -q -rfEs -p no:cacheprovider --junitxml="${OUT}/pytest_gpu.xml" \
    2>&1 | tee "${OUT}/pytest_gpu.txt" | tail -60
step=${PIPESTATUS[0]}
[[ ${step} -ne 0 && ${status} -eq 0 ]] && status=${step}

echo "== benchmarks/bench_kernels.py --quick"
timeout 210 python benchmarks/bench_kernels.py --quick --out "${OUT}/bench_kernels.json" \
    2>&1 | tee "${OUT}/bench_kernels.txt"
step=${PIPESTATUS[0]}
[[ ${step} -ne 0 && ${status} -eq 0 ]] && status=${step}

echo "gpu_check status ${status} (pytest, then bench; 124 = a step ran out of time)" | tee -a "${OUT}/env.txt"
exit "${status}"
