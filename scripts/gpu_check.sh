#!/usr/bin/env bash
# The one prepared GPU check: the `gpu`-marked tests, then the GPU benchmarks, every step time-boxed and all output
# written under $OUT. Run from the repository root of a checkout where torch, triton, transformers, peft and
# safetensors are already installed; it never installs anything and needs no network.
#
#   OUT=/tmp/gpu-results PYTHONPATH=src scripts/gpu_check.sh              # every step (up to ~20 minutes)
#   OUT=/tmp/gpu-results PYTHONPATH=src scripts/gpu_check.sh tests kernels  # only the steps named
# A device call lasts at most 10 minutes and a session gets about 15 minutes of device time in all, start-up (a few
# minutes) included, so every step cannot run in one session. In order of what they prove: `tests compiled engine`
# first (<= 9.5 min: the gpu tests, the compiled engine's, then issue 6's benchmarks), then, with the time left,
# `generate kernels` (<= 3 min), then `serving load quant`.
#
# Steps, in order, with their time boxes (seconds):
#   tests     pytest -m gpu tests/kernels, then the other gpu tests (150 + 130)  pytest_gpu_kernels.txt,
#             pytest_gpu_rest.txt + .xml each (two runs, so that a time-out loses only one half)
#   compiled  the compiled engine's gpu tests (issue 30: torch.compile'd decoder, CUDA graphs captured over it,
#             float32 and bf16; each compiles the decoder, so they have a box of their own)  (120)
#             pytest_gpu_compiled.txt + .xml
#   kernels   benchmarks/bench_kernels.py --quick                  (90)   bench_kernels.txt + .json
#   generate  benchmarks/bench_generate.py on cuda, bf16, --big    (80)   bench_generate.txt
#   engine    benchmarks/bench_offline.py --gpu (fewer requests)   (130)  bench_offline.txt + .json
#             (ours with and without CUDA graphs and async batching, and transformers' generate_batch),
#             then benchmarks/bench_engine_host.py --streaming (30)  bench_engine_host.txt
#   load      benchmarks/bench_load.py --device cuda --repeats 1   (50)   bench_load.txt
#   serving   benchmarks/bench_serving.py --gpu, 64 then 256 clients (60 + 80)  bench_serving_64.txt, _256.txt
#   quant     benchmarks/bench_quant.py on cuda, bf16, --big       (120)  bench_quant.txt
#             (bitsandbytes rows only where the package is installed)
#   peer      benchmarks/bench_peer.py --device cuda, bf16, 100m, --compile (180)  bench_peer.txt + .json
#             (issue 30: the compiled engine against the eager one, start-up cold; vLLM only where installed)
#   frontend  benchmarks/bench_serving_host.py --clients 64 256 --max-tokens 512 --api-server-count 4 (150)
#             bench_serving_host.txt (issue 31: whether 4 API servers keep up with a 5 ms step at 256 streams of 512
#             tokens, long enough that the requests' arrival is not most of the round, on the machine's 16 cores; no
#             GPU work: the development machine's 2 cores cannot show it. Needs the serving packages, which the
#             machine lacks, and the Qwen3 tokenizer: scripts/fetch_serving_wheels.sh here, then carry `.whl` and
#             `.cache/assets/qwen3-tokenizer` and start the command with that script's install line)
# env.txt records the GPU, driver and versions first. A step that runs out of time exits 124 and the next one runs.
# Exit status: 0 when every step passed, else the first failing step's status.
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
OUT="${OUT:-${repo_root}/out/gpu_check}"
mkdir -p "${OUT}"
export PYTHONPATH="${repo_root}/src${PYTHONPATH:+:${PYTHONPATH}}"
unset TRITON_INTERPRET  # real kernels on the GPU, never the interpreter
export PYTHONDONTWRITEBYTECODE=1 TQDM_DISABLE=1

steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests compiled kernels generate engine load serving quant peer frontend)

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
# which attention backends and kernels can run on this GPU, and why not (flash_attention_4's gpu tests skip without it)
try:
    from gpuformers.doctor import env_report

    for row in env_report()["backends"]:
        print("backend", row["name"], "runs" if row["runs"] else "no", row["why"])
except Exception as err:
    print("backends not reported:", type(err).__name__, err)
PY
} > "${OUT}/env.txt" 2>&1
cat "${OUT}/env.txt"

status=0
run_step() {  # name, seconds, output file, command...
    local name="$1" seconds="$2" file="$3"
    shift 3
    echo "== ${name}: $*"
    local start=${SECONDS}
    timeout "${seconds}" "$@" 2>&1 | tee "${OUT}/${file}" | tail -40
    local step=${PIPESTATUS[0]}
    echo "== ${name}: exit ${step} after $((SECONDS - start)) s" | tee -a "${OUT}/env.txt"
    [[ ${step} -ne 0 && ${status} -eq 0 ]] && status=${step}
}

for step in "${steps[@]}"; do
    case "${step}" in
        tests)
            run_step tests-kernels 150 pytest_gpu_kernels.txt python -m pytest -m gpu -q -rfEs -p no:cacheprovider \
                --junitxml="${OUT}/pytest_gpu_kernels.xml" tests/kernels
            # -v: a line per test, so a run cut by its time box still says which tests passed
            run_step tests-rest 130 pytest_gpu_rest.txt python -m pytest -m gpu -v -rfEs -p no:cacheprovider \
                --junitxml="${OUT}/pytest_gpu_rest.xml" --ignore=tests/kernels \
                --ignore=tests/engine/test_compiled_engine.py --ignore=tests/engine/test_compiled_cuda_graphs.py tests ;;
        # four compiles, two of them cold (float32, bf16); test_compiled_engine's cuda_graph_decodes cases are left
        # out: test_compiled_cuda_graphs runs the same engine with graphs and checks more (the capture's calls)
        compiled) run_step compiled 120 pytest_gpu_compiled.txt python -m pytest -m gpu -v -rfEs -p no:cacheprovider \
            --junitxml="${OUT}/pytest_gpu_compiled.xml" -k "not cuda_graph_decodes" \
            tests/engine/test_compiled_engine.py tests/engine/test_compiled_cuda_graphs.py ;;
        kernels) run_step kernels 90 bench_kernels.txt \
            python benchmarks/bench_kernels.py --quick --out "${OUT}/bench_kernels.json" ;;
        generate) run_step generate 80 bench_generate.txt \
            python benchmarks/bench_generate.py --device cuda --dtype bfloat16 --big --repeats 2 ;;
        engine)
            run_step engine 130 bench_offline.txt \
                python benchmarks/bench_offline.py --gpu --num-requests 128 --json "${OUT}/bench_offline.json"
            # the engine's host work per step on this machine's CPU (a stand-in model: no GPU time)
            run_step engine-host 30 bench_engine_host.txt python benchmarks/bench_engine_host.py --streaming ;;
        load) run_step load 50 bench_load.txt python benchmarks/bench_load.py --device cuda --repeats 1 ;;
        serving)
            run_step serving-64 60 bench_serving_64.txt python benchmarks/bench_serving.py --gpu --clients 64 --rounds 2
            run_step serving-256 80 bench_serving_256.txt \
                python benchmarks/bench_serving.py --gpu --clients 256 --rounds 2 ;;
        quant) run_step quant 120 bench_quant.txt \
            python benchmarks/bench_quant.py --device cuda --dtype bfloat16 --big --repeats 2 ;;
        peer) run_step peer 180 bench_peer.txt python benchmarks/bench_peer.py --device cuda --dtype bfloat16 \
            --shape 100m --num-requests 64 --compile --json "${OUT}/bench_peer.json" ;;
        frontend) run_step frontend 150 bench_serving_host.txt \
            python benchmarks/bench_serving_host.py --clients 64 256 --max-tokens 512 --api-server-count 4 ;;
        *) echo "unknown step ${step}; steps: tests compiled kernels generate engine load serving quant peer" \
                "frontend" >&2
           exit 2 ;;
    esac
done

echo "gpu_check status ${status} (124 = a step ran out of time)" | tee -a "${OUT}/env.txt"
exit "${status}"
