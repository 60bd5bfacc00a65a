"""Benchmark: batch-1 greedy decode through generate(), gpuformers' compiled static-cache step against transformers'
eager generate, for several families on the same tiny shape, in one run.

The claim (issue 30): on the tiny shape, where per-token overhead dominates, our decode through the compiled step
(`cache_implementation="static"` with a `compile_config`: on the CPU, Inductor with weight freezing and
concatenated sibling matmuls, and for qwen3_moe each token's experts gathered inside the graph,
generation/compiled_step.py) is at least 2x transformers' eager decode, for llama, qwen3, gemma2 and a
mixture-of-experts family (qwen3_moe).

Both libraries run the same random weights (ours loads the checkpoint transformers saves), the same prompt and
thread count. Decode speed is the difference of two generate() calls, N new tokens and 1 new token, so the prefill cancels out:
tokens/s = (N - 1) / (t_N - t_1). Every configuration runs `--repeats` times, interleaved, and the best time
counts (other processes only ever add time). eos is off. The compiled step's first call (compiling) is reported
apart. Each model's compiled tokens are checked against its eager tokens and transformers'.

    python benchmarks/bench_decode_families.py --threads 1
    python benchmarks/bench_decode_families.py --threads 1 --families llama qwen3_moe --repeats 5
"""

from __future__ import annotations

import argparse
import time

import torch

TINY = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, vocab_size=16384, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
# Per family: the tiny shape's changes (experts for the MoE: 8 of 384 wide, 2 per token).
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "gemma2": dict(sliding_window=4096, query_pre_attn_scalar=64),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384, decoder_sparse_step=1,
                      norm_topk_prob=True),
}


def build(family: str):
    """A random transformers model of the family and ours loaded from its saved checkpoint by our loader (which maps
    transformers' fused expert tensors, mlp.experts.gate_up_proj / down_proj, onto our per-expert layers: loading its
    state dict directly left qwen3_moe's experts at their random init)."""
    import tempfile

    import transformers

    from gpuformers import AutoModelForCausalLM

    hf_config = transformers.AutoConfig.for_model(family, **TINY, **FAMILIES[family], bos_token_id=1,
                                                  eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, progress=False)
    return hf, ours.eval()


def timed(generate, prompt, new_tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        out = generate(prompt, new_tokens)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens, "eos stopped a benchmark run early"
    return elapsed


def bench_family(family: str, args) -> dict[str, float]:
    from gpuformers.generation.config import CompileConfig

    hf, ours = build(family)
    prompt = torch.randint(2, TINY["vocab_size"], (1, args.prompt_length))
    n = args.new_tokens
    variants = {
        "transformers": lambda p, k: hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=k,
                                                 do_sample=False, eos_token_id=None, pad_token_id=0),
        "ours eager": lambda p, k: ours.generate(p, max_new_tokens=k, eos_token_id=None),
        # A cache of n + prompt slots for both lengths: one compiled graph serves both timed calls.
        "ours compiled": lambda p, k: ours.generate(p, max_new_tokens=k, eos_token_id=None,
                                                    cache_implementation="static", max_cache_len=p.shape[1] + n,
                                                    compile_config=CompileConfig(mode="default")),
    }
    start = time.perf_counter()
    compiled = variants["ours compiled"](prompt, n)
    first = time.perf_counter() - start
    same = torch.equal(compiled, variants["ours eager"](prompt, n))
    same_as_transformers = torch.equal(compiled, variants["transformers"](prompt, n))
    for generate in variants.values():  # warm up
        timed(generate, prompt, 4)
    times = {key: {1: [], n: []} for key in variants}
    for _ in range(args.repeats):
        for key, generate in variants.items():
            for k in (1, n):
                times[key][k].append(timed(generate, prompt, k))
    speed = {key: (n - 1) / (min(times[key][n]) - min(times[key][1])) for key in variants}
    base = speed["transformers"]
    print(f"{family}: " + ", ".join(f"{k} {v:.1f} tok/s ({v / base:.2f}x)" for k, v in speed.items())
          + f"; compiled first call {first:.1f} s, tokens {'same as eager' if same else 'DIFFER from eager'}"
          + f", {'same as' if same_as_transformers else 'DIFFER from'} transformers'", flush=True)
    return speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both libraries")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per timed call (default: 64)")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (the best counts)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"tiny shape {TINY}, batch 1, {torch.get_num_threads()} threads, {args.new_tokens} new tokens")
    for family in args.families:
        bench_family(family, args)


if __name__ == "__main__":
    main()
