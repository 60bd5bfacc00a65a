"""Offline throughput of the continuous batching engine, after nano-vllm's benchmark: random prompts, input and
output lengths uniform in a range, eos ignored, output tokens per second. In the same run and on the same random
weights, it times:

  ours            gpuformers' engine (paged KV cache, chunked prefill, prefix sharing; on a GPU also with and
                  without CUDA graphs and async batching)
  hf_generate     transformers' generate on left-padded batches (each batch decodes to its longest request;
                  only the requested tokens are counted)
  hf_cb           transformers' own continuous batching (init_continuous_batching, the engine behind
                  generate_batch), with each request's own max_new_tokens

and prints tokens/s and the ratios ours / theirs.

    python benchmarks/bench_offline.py --quick                 # seconds: a small model, 16 requests
    python benchmarks/bench_offline.py                         # CPU scale: ~100M Qwen3-shaped, 64 requests, [16, 256]
    python benchmarks/bench_offline.py --gpu                   # Qwen3-0.6B shape, bf16, 256 requests, [100, 1024]
"""

from __future__ import annotations

import argparse
import json
import random
import time

SCRIPT_START = time.perf_counter()  # for the start-up time: script start -> our first token

import torch  # noqa: E402  (after the clock starts: importing torch is part of start-up)

SHAPES = {
    # Qwen3-shaped, scaled down: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=768, vocab_size=8192, head_dim=64),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000, head_dim=64),
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, vocab_size=151936, head_dim=128),
}


def build_ours(shape: str, dtype: torch.dtype, device: str):
    """Our Qwen3-shaped model with random weights, made on the device. Built first, before transformers is even
    imported, so that the start-up time (script start -> our first token) counts only our own path."""
    from gpuformers import AutoModelForCausalLM
    from gpuformers.models.config import ModelConfig

    config = ModelConfig.from_dict(dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], **SHAPES[shape],
                                        max_position_embeddings=4096, tie_word_embeddings=True))
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def build_hf(ours, shape: str, dtype: torch.dtype, device: str):
    """transformers' model with our model's weights."""
    import transformers

    config = transformers.Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.load_state_dict(ours.state_dict())
    return hf.eval()


def make_requests(num: int, low: int, high: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]
    outputs = [rng.randint(low, high) for _ in range(num)]
    return prompts, outputs


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Free the last engine's KV cache before the next contender sizes its own from free memory."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_ours(model, prompts, outputs, device, **engine) -> tuple[float, int, float]:
    """-> (seconds for all requests, preemptions, seconds from script start to the warm-up's first token)."""
    manager = model.init_continuous_batching(eos_token_id=None, **engine)
    manager.add_request(prompts[0][:8], max_new_tokens=4)  # warm-up: first-call allocations, not timed
    manager.step()
    sync(device)
    first_token = time.perf_counter() - SCRIPT_START
    manager.run_until_done()
    sync(device)
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, outputs)]
    manager.run_until_done()
    sync(device)
    elapsed = time.perf_counter() - start
    results = [manager.get_result(i, timeout=0) for i in ids]
    tokens = sum(len(r.generated_tokens) for r in results)
    assert tokens == sum(outputs), "the engine produced a different number of tokens than asked"
    preemptions = manager.num_preemptions
    del manager, results
    release(device)
    return elapsed, preemptions, first_token


def run_hf_generate(model, prompts, outputs, device, batch_size: int) -> float:
    pad = 0
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad
    elapsed = 0.0
    for first in range(0, len(prompts), batch_size):
        rows, lengths = prompts[first:first + batch_size], outputs[first:first + batch_size]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lengths), do_sample=False,
                           eos_token_id=None, pad_token_id=pad)
        sync(device)
        elapsed += time.perf_counter() - start
    return elapsed


def run_hf_cb(model, prompts, outputs, device) -> float:
    import transformers

    config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=16)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        manager.add_request(prompts[0][:8], max_new_tokens=4)  # warm-up
        manager.get_result(timeout=600)
        sync(device)
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, outputs)):
            manager.add_request(p, request_id=f"bench_{i}", max_new_tokens=n)
        done = 0
        while done < len(prompts):
            if manager.get_result(timeout=600) is None:
                raise RuntimeError("transformers' continuous batching returned nothing for 10 minutes")
            done += 1
        sync(device)
        return time.perf_counter() - start
    finally:
        manager.stop(block=True)
        del manager
        release(device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny model, 16 requests, lengths [16, 64]")
    parser.add_argument("--gpu", action="store_true", help="Qwen3-0.6B shape in bfloat16, 256 requests, [100, 1024]")
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--min-len", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--hf-batch-size", type=int, help="rows per padded generate batch (default: all)")
    parser.add_argument("--max-batch-tokens", type=int)
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--no-async-batching", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="time only our engine")
    parser.add_argument("--skip-hf-generate", action="store_true")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 on a machine whose cores are shared: a "
                        "second OpenMP thread then makes small ops hundreds of times slower)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    preset = dict(shape="100m", num=64, low=16, high=256, device="cpu", dtype=torch.float32)
    if args.quick:
        preset.update(shape="tiny", num=16, low=16, high=64)
    if args.gpu:
        preset.update(shape="0.6b", num=256, low=100, high=1024, device="cuda", dtype=torch.bfloat16)
    shape = args.shape or preset["shape"]
    num = args.num_requests or preset["num"]
    low, high = args.min_len or preset["low"], args.max_len or preset["high"]
    device, dtype = preset["device"], preset["dtype"]
    if args.threads:
        torch.set_num_threads(args.threads)

    ours = build_ours(shape, dtype, device)
    prompts, outputs = make_requests(num, low, high, SHAPES[shape]["vocab_size"], args.seed)
    total = sum(outputs)
    params = sum(p.numel() for p in ours.parameters()) / 1e6
    print(f"model {shape} ({params:.0f}M params, {dtype}, {device}), {num} requests, input and output lengths "
          f"uniform in [{low}, {high}], {total} output tokens, {torch.get_num_threads()} threads")

    engine = {}
    if args.max_batch_tokens:
        engine["max_batch_tokens"] = args.max_batch_tokens
    if args.no_cuda_graph:
        engine["use_cuda_graph"] = False
    if args.no_async_batching:
        engine["use_async_batching"] = False
    results = {}
    elapsed, preemptions, first_token = run_ours(ours, prompts, outputs, device, **engine)
    results["ours"] = total / elapsed
    results["startup_s"] = first_token
    print(f"ours          {elapsed:8.2f} s  {total / elapsed:9.1f} tok/s  ({preemptions} preemptions; "
          f"script start -> first token {first_token:.1f} s: imports, our model made on {device} with random "
          f"weights, the engine set up)")
    if device == "cuda" and not args.no_cuda_graph:  # the same run without CUDA graphs, for their effect
        elapsed, _, _ = run_ours(ours, prompts, outputs, device, **{**engine, "use_cuda_graph": False})
        results["ours_no_graph"] = total / elapsed
        print(f"ours_no_graph {elapsed:8.2f} s  {total / elapsed:9.1f} tok/s")
    if device == "cuda" and not args.no_async_batching:  # and without async batching, for its effect
        elapsed, _, _ = run_ours(ours, prompts, outputs, device, **{**engine, "use_async_batching": False})
        results["ours_no_async"] = total / elapsed
        print(f"ours_no_async {elapsed:8.2f} s  {total / elapsed:9.1f} tok/s")
    hf = None if args.skip_hf else build_hf(ours, shape, dtype, device)
    if hf is not None and not args.skip_hf_generate:
        elapsed = run_hf_generate(hf, prompts, outputs, device, args.hf_batch_size or num)
        results["hf_generate"] = total / elapsed
        print(f"hf_generate   {elapsed:8.2f} s  {total / elapsed:9.1f} tok/s  "
              f"(ours is {results['ours'] / results['hf_generate']:.2f}x)")
    if hf is not None:
        elapsed = run_hf_cb(hf, prompts, outputs, device)
        results["hf_cb"] = total / elapsed
        print(f"hf_cb         {elapsed:8.2f} s  {total / elapsed:9.1f} tok/s  "
              f"(ours is {results['ours'] / results['hf_cb']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=shape, requests=num, low=low, high=high, output_tokens=total, tok_s=results), f)


if __name__ == "__main__":
    main()
