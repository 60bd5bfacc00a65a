"""Benchmark: the engine on a hybrid (mamba + attention) model against transformers' generate(), and the prefill that
hybrid prefix caching saves (issue 27).

One Nemotron-H-shaped checkpoint of ~100M parameters with random weights (mamba, attention, MLP blocks; saved by
transformers, loaded by both), float32 on the CPU, both contenders in this process with the same torch threads:

  1. throughput: N random prompts (lengths uniform in [min, max]), greedy, eos ignored, `--new-tokens` each.
     gpuformers: `generate_batch` (the continuous-batching engine with its state slots). transformers:
     `NemotronHForCausalLM.generate` over the same prompts left-padded in batches of `--hf-batch` (its best: one
     padded batch of all of them by default). Output tokens per second, alternating `--repeats` times, and how
     many sequences are identical.
  2. prefix caching: `--shared` requests whose prompts start with one `--prefix`-token system prompt followed by
     16-64 tokens of their own, arriving one per engine step, prefix cache on and off (alternating, twice each,
     the faster kept): prompt tokens computed (prefill), wall time, and whether the outputs are identical.

    python benchmarks/bench_hybrid_engine.py                  # ~100M, 16 requests, 2 repeats
    python benchmarks/bench_hybrid_engine.py --layers 6 --hidden 256 --num-requests 8 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch


def nemotron_h_config(hidden: int, layers: int, vocab: int) -> dict:
    """A Nemotron-H pattern of mamba (M), MLP (-) and attention (*) blocks: M-M*-M-M*-M- ... cut at `layers`."""
    pattern = ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mlp", "mamba", "attention", "mlp",
               "mamba", "mlp"]
    blocks = [pattern[i % len(pattern)] for i in range(layers)]
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, layers_block_type=blocks,
                num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 192),
                head_dim=64, mamba_num_heads=2 * hidden // 64, mamba_head_dim=64, ssm_state_size=64, n_groups=8,
                chunk_size=128, max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=2,
                pad_token_id=0, bos_token_id=1)


def build_checkpoint(folder: str, config: dict):
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model("nemotron_h", **config)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    hf.save_pretrained(folder)
    return hf


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, batch: int) -> list[list[int]]:
    out = []
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            seqs = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        out += seqs[:, width:].tolist()
    return out


def ours_generate(model, prompts, new_tokens, config=None) -> list[list[int]]:
    outputs = model.generate_batch(prompts, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                   progress_bar=False, continuous_batching_config=config)
    return [o.generated_tokens for o in outputs.values()]


def shared_prefix_run(model, prompts, new_tokens, sharing: bool):
    """Requests arriving one per engine step; -> (outputs, prompt tokens computed, seconds)."""
    from gpuformers.engine.config import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(allow_block_sharing=sharing, max_requests_per_batch=32)
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    start = time.perf_counter()
    pending, ids = list(prompts), []
    while True:
        if pending:
            ids.append(manager.add_request(pending.pop(0), max_new_tokens=new_tokens, do_sample=False))
        if not manager.step() and not pending:
            break
    seconds = time.perf_counter() - start
    outputs = [manager.get_result(i, timeout=0).generated_tokens for i in ids]
    skipped = manager.prefix_hits * manager.config.block_size
    return outputs, sum(map(len, prompts)) - skipped, seconds, manager.states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--min-input", type=int, default=64)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=0, help="transformers' batch (default: all requests)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--shared", type=int, default=24)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from gpuformers import AutoModelForCausalLM

    rng = random.Random(0)
    config = nemotron_h_config(args.hidden, args.layers, args.vocab)
    with tempfile.TemporaryDirectory() as folder:
        hf = build_checkpoint(folder, config)
        ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params = sum(p.numel() for p in ours.parameters())
    print(f"Nemotron-H-shaped, {params / 1e6:.1f}M parameters, blocks {''.join('M*-'[['mamba', 'attention', 'mlp'].index(b)] for b in config['layers_block_type'])}, "
          f"float32, {args.threads} threads, torch {torch.__version__}")

    # 1. throughput
    prompts = [[rng.randrange(3, min(args.vocab, 10000)) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_requests)]
    batch = args.hf_batch or len(prompts)
    ours_generate(ours, prompts[:2], 4)  # warm-up: the CPU matmul probe, first allocations
    hf_generate(hf, prompts[:2], 4, 2)
    total = args.num_requests * args.new_tokens
    ratios = []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        theirs = hf_generate(hf, prompts, args.new_tokens, batch)
        hf_seconds = time.perf_counter() - start
        start = time.perf_counter()
        mine = ours_generate(ours, prompts, args.new_tokens)
        our_seconds = time.perf_counter() - start
        same = sum(a == b for a, b in zip(mine, theirs))
        ratios.append(hf_seconds / our_seconds)
        print(f"run {repeat + 1}: gpuformers engine {total / our_seconds:.1f} tok/s, transformers generate (batch "
              f"{batch}) {total / hf_seconds:.1f} tok/s, ratio {ratios[-1]:.2f}x; identical sequences "
              f"{same}/{len(prompts)}")
    print(f"throughput ratio (gpuformers / transformers): {min(ratios):.2f}-{max(ratios):.2f}x")

    # 2. prefix caching on a shared system prompt
    prefix = [rng.randrange(3, min(args.vocab, 10000)) for _ in range(args.prefix)]
    shared = [prefix + [rng.randrange(3, min(args.vocab, 10000)) for _ in range(rng.randint(16, 64))]
              for _ in range(args.shared)]
    runs = {}
    for sharing in (False, True, False, True):  # twice each, alternating; the faster of each kept
        run = shared_prefix_run(ours, shared, 16, sharing)
        if sharing not in runs or run[2] < runs[sharing][2]:
            runs[sharing] = run
    (on, computed_on, seconds_on, states), (off, computed_off, seconds_off, _) = runs[True], runs[False]
    print(f"shared prefix ({args.shared} requests, {args.prefix}-token prefix, one arriving per step): prompt tokens "
          f"computed {computed_on} with the prefix cache vs {computed_off} without ({computed_on / computed_off:.2f}x; "
          f"{states.snapshots_taken} state snapshot(s) taken, {states.snapshot_hits} restored); wall "
          f"{seconds_on:.1f} s vs {seconds_off:.1f} s ({seconds_off / seconds_on:.2f}x faster); outputs identical: "
          f"{on == off}")


if __name__ == "__main__":
    main()
