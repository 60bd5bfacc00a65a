"""Benchmark: quantized weights: memory, decode speed and logits error of int8 / int4 (weight-only) and bitsandbytes
NF4 / int8 against the same model unquantized, in the same run.

A random Qwen3-shaped checkpoint is written once and loaded five ways with `from_pretrained(quantization_config=)`.
For each: bytes of the model's tensors (parameters and buffers: what the weights take in memory), batch-1 greedy
decode tokens/s (the difference of a 1-token and an N-token generate call, so the prefill cancels out; best of
--repeats, interleaved), and the largest logits difference from the unquantized model on one prompt, relative to
the largest logit. bitsandbytes rows are skipped when the package is missing.

With --device cuda it first times single layers, the MLP projections of Qwen3-0.6B (1024 <-> 3072) and Qwen3-8B
(4096 <-> 12288) at 1, 16 and 256 rows: the Triton weight-only kernel (what WeightOnlyLinear runs on a GPU) against
dequantize-then-matmul (what it ran before) and the unquantized nn.Linear in the benchmark's dtype, as median
times (triton.testing.do_bench, L2 cleared between calls) and ratios to nn.Linear, in the same run.

    python benchmarks/bench_quant.py                        # ~30M-parameter shape on the CPU, float32
    python benchmarks/bench_quant.py --device cuda --dtype bfloat16 --big    # Qwen3-0.6B shape on a GPU
    python benchmarks/bench_quant.py --device cuda --dtype bfloat16 --layers-only  # the layer table only
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import torch

SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=16384)
BIG = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
           num_key_value_heads=8, head_dim=128, vocab_size=151936)


def write_checkpoint(folder: str, shape: dict) -> None:
    import transformers

    config = transformers.Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096,
                                      bos_token_id=1, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, plus the int4 CPU kernel's own copy of the weights, which
    WeightOnlyLinear builds on its first bfloat16 CPU forward and keeps beside its buffers (not saved)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        tensors += list(getattr(module, "_int4_kernel_cache", None) or ())[1:]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def decode_speed(model, prompt, new_tokens: int, repeats: int, device: str) -> float:
    def run(n):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4)  # warm-up
    one = min(run(1) for _ in range(repeats))
    many = min(run(new_tokens) for _ in range(repeats))
    return (new_tokens - 1) / (many - one)


LAYER_SHAPES = [(1024, 3072), (3072, 1024), (4096, 12288), (12288, 4096)]  # (in, out): up/gate, down projections
LAYER_ROWS = (1, 16, 256)
LAYER_SETTINGS = [(8, None), (4, 128)]  # int8 per channel, int4 g128: WeightOnlyConfig's defaults


def layer_speed(device: str, dtype: torch.dtype) -> None:
    """Per-layer times on a GPU: weight-only kernel / dequantize-then-matmul / nn.Linear, each layout and size."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from gpuformers.kernels.weight_only_matmul import weight_only_matmul
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    print(f"Layers on {torch.cuda.get_device_name(device)}, {str(dtype).removeprefix('torch.')}: median us, "
          "kernel / dequantize-then-matmul / nn.Linear (ratio: nn.Linear time / that time, > 1 is faster)", flush=True)
    for in_features, out_features in LAYER_SHAPES:
        linear = torch.nn.Linear(in_features, out_features, device=device, dtype=dtype)
        for bits, group_size in LAYER_SETTINGS:
            layer = WeightOnlyLinear.from_linear(linear, bits, group_size)
            zeros = layer.zeros if bits == 4 else None
            for rows in LAYER_ROWS:
                x = torch.randn(rows, in_features, device=device, dtype=dtype)
                with torch.no_grad():
                    times = [do_bench(fn, warmup=10, rep=40, return_mode="median") * 1000 for fn in (
                        lambda: weight_only_matmul(x, layer.qweight, layer.scales, zeros, bits, group_size, layer.bias),
                        lambda: F.linear(x, layer.dequantize(), layer.bias),
                        lambda: linear(x))]
                name = f"int{bits} {'g' + str(group_size) if group_size else 'channel'}"
                kernel, dequantized, dense = times
                print(f"  {in_features:5d} -> {out_features:5d}  {name:12s} M={rows:4d}  {kernel:8.1f} / "
                      f"{dequantized:8.1f} / {dense:8.1f} us   ({dense / kernel:.2f}x / {dense / dequantized:.2f}x)",
                      flush=True)  # a time-boxed run keeps the rows it finished
    print()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big", action="store_true", help="the Qwen3-0.6B shape instead of the ~30M one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers-only", action="store_true",
                        help="with --device cuda: time the single layers, not the whole model")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        layer_speed(args.device, getattr(torch, args.dtype))
        if args.layers_only:
            return
    elif args.layers_only:
        parser.error("--layers-only times the Triton kernel, which needs --device cuda")

    from gpuformers import AutoModelForCausalLM
    from gpuformers.quantization import BitsAndBytesConfig, WeightOnlyConfig

    dtype = getattr(torch, args.dtype)
    variants = {"unquantized": None, "int8 (weight-only)": WeightOnlyConfig(bits=8),
                "int4 g128 (weight-only)": WeightOnlyConfig(bits=4, group_size=128)}
    if importlib.util.find_spec("bitsandbytes") is not None:
        variants["bnb nf4"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                 bnb_4bit_compute_dtype=dtype)
        variants["bnb int8"] = BitsAndBytesConfig(load_in_8bit=True)
    shape = BIG if args.big else SMALL
    prompt = torch.randint(2, shape["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1)).to(args.device)
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(folder, shape)
        print(f"Qwen3 shape {shape}, {args.dtype} on {args.device}, {torch.get_num_threads()} threads, batch 1, "
              f"{args.new_tokens} new tokens")
        reference = None
        base = {}
        for name, config in variants.items():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=args.device,
                                                         quantization_config=config, progress=False)
            with torch.no_grad():
                logits = model(prompt).logits.float()
            if reference is None:
                reference = logits
            error = ((logits - reference).abs().max() / reference.abs().max()).item()
            speed = decode_speed(model, prompt, args.new_tokens, args.repeats, args.device)
            size = model_bytes(model)  # after decoding: kernels' caches included
            base.setdefault("size", size)
            base.setdefault("speed", speed)
            print(f"{name:26s} {size / 2**20:8.1f} MiB ({size / base['size']:.2f}x)  {speed:8.1f} tok/s "
                  f"({speed / base['speed']:.2f}x)  max |logits error| / max |logit| {error:.4f}")
            del model


if __name__ == "__main__":
    main()
