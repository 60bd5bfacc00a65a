"""`gpuformers serve MODEL`: load a model, start the continuous batching engine and serve the OpenAI API.

    gpuformers serve Qwen/Qwen3-0.6B --port 8000 --api-key secret --max-num-seqs 64

Offers: add_serve_arguments, run_serve.
"""

from __future__ import annotations

import argparse
import os


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hub id, checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("GPUFORMERS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $GPUFORMERS_API_KEY, "
                             "or no key)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send and /v1/models lists (default: MODEL as given)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (default: auto)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    from gpuformers.generation.cli import add_quantization_argument

    add_quantization_argument(parser)
    parser.add_argument("--attn-implementation", default=None, choices=("sdpa", "eager"),
                        help="attention kernel under the paged cache (default: sdpa)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion in tokens (default: the model's context length)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one engine step (default: 256 on a GPU, 128 on the CPU)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="tokens computed per engine step (default: 2048 on a GPU, 512 on the CPU)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV cache blocks (default: from free memory times --gpu-memory-utilization)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: 256 GPU, 64 CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of free memory the KV cache may take (default: 0.9)")
    parser.add_argument("--max-pending", type=int, default=512,
                        help="engine requests in flight before new ones get 429 at once (default: 512)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM / Ctrl-C (default: 30)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run_serve(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"serving needs the serve extra ({', '.join(missing)} missing): "
                           "pip install 'gpuformers[serve]'")
    for name in ("port", "max_model_len", "max_num_seqs", "max_batch_tokens", "num_blocks", "max_pending"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be >= 1")
    from gpuformers.engine.manager import ContinuousBatchingConfig
    from gpuformers.generation.cli import load_model_and_tokenizer
    from gpuformers.serving.server import run_server

    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.device, args.quantization)
    if args.attn_implementation:
        model.set_attn_implementation(args.attn_implementation)
    config = ContinuousBatchingConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                                      max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_num_seqs,
                                      max_memory_percent=args.gpu_memory_utilization)
    manager = model.init_continuous_batching(continuous_batching_config=config)
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    blocks = manager.block_manager
    print(f"gpuformers serve: {name} on {model.device} ({blocks.num_blocks} KV blocks of {blocks.block_size} "
          f"tokens); listening on http://{args.host}:{args.port}/v1", flush=True)
    run_server(manager, tokenizer, name, host=args.host, port=args.port, api_key=args.api_key,
               max_model_len=args.max_model_len, max_pending=args.max_pending, log_level=args.log_level,
               shutdown_timeout=args.shutdown_timeout)
    return 0
