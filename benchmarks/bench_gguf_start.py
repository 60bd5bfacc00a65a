"""Benchmark: the README's main job from a cold process, gpuformers vs transformers: load the embedded SmolLM2-135M
GGUF (model and tokenizer, `gguf_file=`), apply the chat template to "What is the capital of France?" and decode
greedily, each library in fresh Python processes, timed from process start (imports included) to the answer.

Each library runs in its own process, alternating, `--repeats` times; the median counts. Phases (import, model,
tokenizer, generate) are printed too. Both load float32 on the CPU with the same thread count.

    python benchmarks/bench_gguf_start.py                  # 3 processes per library, 16 new tokens
    python benchmarks/bench_gguf_start.py --repeats 5 --new-tokens 32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
start = time.perf_counter()
library, new_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import torch
if threads:
    torch.set_num_threads(threads)
if library == "gpuformers":
    from gpuformers import AutoModelForCausalLM, AutoTokenizer
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer
from gpuformers.default_model import default_gguf_path
imported = time.perf_counter()
path = default_gguf_path()
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
loaded = time.perf_counter()
tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
tokenized = time.perf_counter()
messages = [{"role": "user", "content": "What is the capital of France?"}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
with torch.no_grad():
    out = model.generate(ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)
done = time.perf_counter()
answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
print(json.dumps({"import": imported - start, "model": loaded - imported, "tokenizer": tokenized - loaded,
                  "generate": done - tokenized, "total": done - start, "answer": answer}))
"""


def run(library: str, new_tokens: int, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, library, str(new_tokens), str(threads)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{library} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in both (0: torch's default)")
    args = parser.parse_args(argv)
    runs = {"gpuformers": [], "transformers": []}
    for _ in range(args.repeats):
        for library in runs:
            runs[library].append(run(library, args.new_tokens, args.threads))
    medians = {}
    for library, results in runs.items():
        medians[library] = {k: statistics.median(r[k] for r in results) for k in
                            ("import", "model", "tokenizer", "generate", "total")}
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in medians[library].items())
        print(f"{library:12s} {phases}   answer: {results[-1]['answer']!r}")
    ours, theirs = medians["gpuformers"]["total"], medians["transformers"]["total"]
    print(f"process start to answer: gpuformers {ours:.2f} s, transformers {theirs:.2f} s "
          f"({theirs / ours:.2f}x faster), median of {args.repeats}")


if __name__ == "__main__":
    main()
