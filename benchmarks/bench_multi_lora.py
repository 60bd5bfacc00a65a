"""Multi-LoRA serving throughput: one engine serving requests for several LoRA adapters at once, against what one
would do without it, one engine per adapter (the adapter merged into a copy of the model, its requests run alone,
adapter after adapter), and against the base model alone on the same requests (the adapters' own cost).

Random Qwen3-shaped weights, random adapters (every linear layer but the head, rank --rank), random prompts and
output lengths uniform in a range, eos ignored, output tokens per second; all in one run, on the same requests.

    python benchmarks/bench_multi_lora.py                       # CPU: the tiny shape, 4 adapters, 64 requests
    python benchmarks/bench_multi_lora.py --shape 100m --adapters 8 --requests 128
    python benchmarks/bench_multi_lora.py --device cuda --shape 0.6b --dtype bfloat16 --requests 512

On a GPU the merged engines may use CUDA graphs and the multi-LoRA engine does not (engine/lora.py): the ratio
then includes that.
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time

import torch

from bench_offline import SHAPES, build_ours, make_requests, release, sync

from gpuformers.lora import PeftModel


def make_adapters(model, count: int, rank: int, folder: str) -> dict[str, str]:
    """`count` random LoRA adapters on every linear layer but the head, saved as peft folders."""
    from gpuformers.lora import LoraConfig, get_peft_model

    adapters = {}
    for index in range(count):
        torch.manual_seed(100 + index)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                      init_lora_weights=False))
        with torch.no_grad():  # small updates, as trained adapters make
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.01)
        path = f"{folder}/adapter{index}"
        peft_model.save_pretrained(path)
        peft_model.unload()
        adapters[f"adapter{index}"] = path
    return adapters


def run(model, prompts, outputs, device, **kwargs) -> float:
    """generate_batch with each request's own output length (max_new_tokens per request through add_request)."""
    names = kwargs.pop("names", None)
    manager = model.init_continuous_batching(eos_token_id=None, **kwargs)
    sync(device)
    start = time.perf_counter()
    with manager:
        ids = [manager.add_request(p, max_new_tokens=n, ignore_eos=True,
                                   **({"adapter_name": names[i]} if names else {}))
               for i, (p, n) in enumerate(zip(prompts, outputs))]
        for request_id in ids:
            result = manager.get_result(request_id, timeout=3600)
            assert result is not None and result.error is None, result
    sync(device)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--low", type=int, default=16)
    parser.add_argument("--high", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = build_ours(args.shape, dtype, args.device)
    vocab = model.config.vocab_size
    prompts, outputs = make_requests(args.requests, args.low, args.high, vocab, seed=0)
    names = [f"adapter{i % args.adapters}" for i in range(args.requests)]
    random.Random(1).shuffle(names)  # requests for every adapter arrive mixed
    tokens = sum(outputs)
    with tempfile.TemporaryDirectory() as folder:
        adapters = make_adapters(model, args.adapters, args.rank, folder)
        run(model, prompts[:4], [4] * 4, args.device)  # warm-up
        base = run(model, prompts, outputs, args.device)
        multi = run(model, prompts, outputs, args.device, adapters=adapters, names=names)
        merged = 0.0
        for name, path in adapters.items():  # one engine per adapter: a copy with it merged, its requests alone
            merged_model = PeftModel.from_pretrained(copy.deepcopy(model), path).merge_and_unload()
            rows = [i for i, n in enumerate(names) if n == name]
            merged += run(merged_model, [prompts[i] for i in rows], [outputs[i] for i in rows], args.device)
            del merged_model
            release(args.device)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model {args.shape} ({params:.0f}M params, {dtype}, {args.device}), {args.requests} requests over "
          f"{args.adapters} adapters (rank {args.rank}, all linear layers), lengths in [{args.low}, {args.high}], "
          f"{tokens} output tokens, {args.threads} threads")
    print(f"multi-LoRA engine          {multi:8.2f} s  {tokens / multi:8.1f} tok/s")
    print(f"one engine per adapter     {merged:8.2f} s  {tokens / merged:8.1f} tok/s  (multi-LoRA is "
          f"{merged / multi:.2f}x)")
    print(f"base model, no adapters    {base:8.2f} s  {tokens / base:8.1f} tok/s  (adapters cost "
          f"{100 * (multi / base - 1):.0f}%)")


if __name__ == "__main__":
    main()
