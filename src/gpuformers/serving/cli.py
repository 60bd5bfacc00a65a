"""`gpuformers serve MODEL`: load a model, start the continuous batching engine and serve the OpenAI API.

    gpuformers serve Qwen/Qwen3-0.6B --port 8000 --api-key secret --max-num-seqs 64
    gpuformers serve Qwen/Qwen3-8B --tensor-parallel-size 2       # the model split over 2 GPUs
    gpuformers serve Qwen/Qwen3-0.6B --lora-modules sql=./sql-lora chat=./chat-lora   # "model": "sql" uses it
    gpuformers serve Qwen/Qwen3-Embedding-0.6B --task embed        # POST /v1/embeddings (serving/embedding_app.py)

With --tensor-parallel-size N the command starts itself again under torchrun with N processes (or, already under
torchrun, uses its processes): each loads its slices of the model (tp_plan="auto"), process 0 serves HTTP and the
engines of all the processes step in lockstep (engine/lockstep.py). The others ignore SIGTERM and Ctrl-C: they end
when process 0's engine stops, after its graceful shutdown.

The checkpoint's generation_config.json gives what a request that leaves out temperature, top_p, top_k, max_tokens,
repetition_penalty or min_p gets, else OpenAI's defaults (serving/sampling_defaults.py); a field in it that the
engine does not implement (no_repeat_ngram_size, say) is dropped with a warning rather than failing every request,
since no request can set it anyway.

With --api-server-count N > 1 this process keeps the engine and N API server processes serve HTTP on the same
port (serving/engine_core.py, api_server.py, engine_client.py); 1 (the default on 4 cores or fewer) serves HTTP in
this process.

With --task embed the model is loaded as a bare decoder (AutoModel) and serves only /v1/embeddings, pooled as its
sentence-transformers files say (serving/pooling.py); the engine flags do not apply.

Offers: add_serve_arguments, run_serve.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hub id, checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--task", default="generate", choices=("generate", "embed"),
                        help="generate: completions, chat and responses on the batching engine (default); embed: "
                             "POST /v1/embeddings with an embedding model, e.g. gpuformers serve "
                             "Qwen/Qwen3-Embedding-0.6B --task embed")
    from gpuformers.serving.pooling import POOLING_MODES

    parser.add_argument("--pooling", default=None, choices=POOLING_MODES,
                        help="--task embed: pool each input's hidden states at its last token, their mean or the "
                             "first (cls) token (default: the checkpoint's sentence-transformers Pooling, else last)")
    parser.add_argument("--no-normalize", dest="normalize", action="store_false", default=None,
                        help="--task embed: return the pooled vectors as they are, not L2-normalised (default: "
                             "normalised unless the checkpoint's modules.json has no Normalize module)")
    parser.add_argument("--hf-overrides", default=None, metavar="JSON",
                        help="--task embed: config.json fields to override (vLLM's flag), e.g. --hf-overrides "
                             "'{\"is_matryoshka\": true}' to accept the dimensions field for a model trained with "
                             "Matryoshka whose config.json does not say so (Qwen3-Embedding), or "
                             "'{\"matryoshka_dimensions\": [256, 512, 1024]}' to allow only those sizes")
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
    from gpuformers.models.command_line import add_kernel_arguments, add_quantization_argument

    add_quantization_argument(parser)
    add_kernel_arguments(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion in tokens (default: the model's context length)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one engine step (default: 256 on a GPU, 128 on the CPU)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="tokens computed per engine step (default: 2048 on a GPU, 512 on the CPU)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV cache blocks (default: from free memory times --gpu-memory-utilization)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: 256 GPU, 64 CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the engine's decoder (ContinuousBatchingConfig.compile): faster steps "
                             "after 20-60 s of compiling at the first ones; --no-compile keeps them eager "
                             "(default: eager, or compiled where GPUFORMERS_ENGINE_COMPILE=1)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of free memory the KV cache may take (default: 0.9)")
    parser.add_argument("--max-pending", type=int, default=512,
                        help="engine requests in flight before new ones get 429 at once (default: 512)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM / Ctrl-C (default: 30)")
    parser.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="a connection whose request headers are not all in within this many seconds (of its "
                             "accept, or of the request's first byte) is closed: half-open and slow-loris "
                             "connections (default: 10)")
    parser.add_argument("--timeout-keep-alive", type=float, default=75.0, metavar="SECONDS",
                        help="an idle kept-alive connection is closed after this many seconds; keep it above the "
                             "idle timeout of the clients' or the proxy's connection pool, e.g. --timeout-keep-alive "
                             "90 behind a proxy that keeps upstream connections 60 s (default: 75)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="open connections at most; past it an idle kept-alive one is closed to make room, else "
                             "the new one gets a 503 (default: 3/4 of the open-file limit, ulimit -n, which the "
                             "server raises to its hard limit; at most 16384)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=FOLDER",
                        help="LoRA adapters served beside the base model (vLLM's flag): a request whose \"model\" is "
                             "NAME runs with the peft adapter in FOLDER (or Hub id), e.g. --lora-modules "
                             "sql=./sql-lora chat=./chat-lora; /v1/models lists them with the base as parent")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="add POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter "
                             "{lora_name} (vLLM's routes): adapters loaded and unloaded while serving. Off by default: "
                             "a request then names a folder the server reads (use with --api-key)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="split the model over this many processes, one per GPU (started with torchrun; "
                             "default: the number of torchrun processes, else 1)")
    from gpuformers.serving.reasoning import REASONING_PARSERS
    from gpuformers.serving.tool_calls import TOOL_CALL_PARSERS, load_parser_modules

    load_parser_modules()  # every parser in its registry before they are listed

    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                        help="the format of the model's tool calls, parsed out of chat answers to requests with tools "
                             "(default: detected from the chat template; hermes for Qwen2.5, Qwen3, Hermes; openai "
                             "for gpt-oss)")
    parser.add_argument("--reasoning-parser", default=None, choices=[*sorted(REASONING_PARSERS), "none"],
                        help="split chat answers into message.reasoning_content (the <think> block) and content, e.g. "
                             "--reasoning-parser qwen3 (default: detected from the chat template: qwen3 for Qwen3, "
                             "deepseek_r1 when the template opens the think block, gpt_oss for gpt-oss's harmony "
                             "channels; none: the text as generated)")
    parser.add_argument("--api-server-count", type=int, default=None, metavar="N",
                        help="HTTP front-end processes: 1 runs it in the engine's process; N > 1 runs the engine in "
                             "this process and N API server processes (HTTP, tokenization, detokenization, SSE) "
                             "sharing the port, so their Python never holds the engine's GIL (default: 1 on a "
                             "machine with 4 cores or fewer, else cores // 4, at most 4)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run_serve(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"serving needs the serve extra ({', '.join(missing)} missing): "
                           "pip install 'gpuformers[serve]'")
    for name in ("port", "max_model_len", "max_num_seqs", "max_batch_tokens", "num_blocks", "max_pending",
                 "tensor_parallel_size", "api_server_count"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be >= 1")
    from gpuformers.serving.http import check_api_key_setting

    check_api_key_setting(args.api_key)  # before the minutes a model can take to load
    limits = _connection_limits(args)  # its errors before the minutes a model can take to load
    from gpuformers import distributed

    processes = distributed.world_size()
    if args.task == "embed":
        return _run_embed(args, args.served_model_name or args.model, processes)
    if "WORLD_SIZE" not in os.environ and (args.tensor_parallel_size or 1) > 1:  # not started by torchrun yet
        return _restart_under_torchrun(args.tensor_parallel_size)
    if args.tensor_parallel_size not in (None, processes):
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} under torchrun with {processes} "
                         f"processes: they must be equal (or leave --tensor-parallel-size out)")
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    if args.pooling is not None or args.normalize is not None:
        raise ValueError("--pooling and --no-normalize apply to embedding models: add --task embed")
    if args.hf_overrides is not None:
        raise ValueError("--hf-overrides applies to embedding models (--task embed) only")
    api_servers = args.api_server_count or default_api_server_count()
    if api_servers > 1:
        _check_api_servers(args, processes)
    adapters = _lora_modules(args.lora_modules)
    if name in adapters:
        raise ValueError(f"--lora-modules names an adapter {name!r}, the base model's own name; rename the adapter")
    from gpuformers.engine.config import ContinuousBatchingConfig
    from gpuformers.models.command_line import kernel_options, load_model_and_tokenizer
    from gpuformers.serving.server import run_server

    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.device, args.quantization,
                                                tensor_parallel=processes > 1, kernels=kernel_options(args))
    config = ContinuousBatchingConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                                      max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_num_seqs,
                                      max_memory_percent=args.gpu_memory_utilization, compile=args.compile)
    _drop_unhonoured_defaults(model)
    manager = model.init_continuous_batching(continuous_batching_config=config, adapters=adapters)
    manager.runner.reserve_cache()  # the server's RSS is its whole footprint from the start (model_runner.py)
    if processes > 1:
        manager.run_in_lockstep()
        if not distributed.is_main_process():
            _follow(manager)  # does not return
    print(f"gpuformers serve: {name} on {model.device} ({manager.memory_summary()}); listening on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    from gpuformers.serving.sampling_defaults import SamplingDefaults

    # what a request without temperature gets, as vLLM warns when the model's file overrides its defaults
    print(f"gpuformers serve: {SamplingDefaults.from_generation_config(manager.generation_config).describe()}",
          flush=True)
    if api_servers > 1:
        return _run_engine_core(args, manager, tokenizer, name, api_servers, limits)
    code = 1
    try:
        run_server(manager, tokenizer, name, host=args.host, port=args.port, api_key=args.api_key,
                   max_model_len=args.max_model_len, max_pending=args.max_pending, log_level=args.log_level,
                   shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
                   reasoning_parser=args.reasoning_parser,
                   allow_runtime_lora_updating=args.allow_runtime_lora_updating, limits=limits)
        code = 0
    except SystemExit as stop:  # the graceful shutdown on SIGTERM / Ctrl-C ends with sys.exit(0)
        code = stop.code if isinstance(stop.code, int) else 0
        raise
    finally:
        if processes > 1:  # the engine has stopped (and told the others): leave without torch's teardown
            distributed.exit_process(code)
    return 0


def default_api_server_count(cores: int | None = None) -> int:
    """--api-server-count's default: 1 (the front end in the engine's process) on 4 cores or fewer, where more
    processes would only compete with the engine for the same cores; else cores // 4, at most 4."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cores <= 4 else min(4, cores // 4)


def _check_api_servers(args: argparse.Namespace, processes: int) -> None:
    """Refuse, by name, what API server processes do not do yet."""
    if processes > 1 or (args.tensor_parallel_size or 1) > 1:
        raise NotImplementedError("--api-server-count > 1 with --tensor-parallel-size is not implemented: the "
                                  "tensor-parallel server runs its front end in process 0; use --api-server-count 1")
    if args.allow_runtime_lora_updating:
        raise NotImplementedError("--allow-runtime-lora-updating with --api-server-count > 1 is not implemented "
                                  "(each API server would have to reach the engine core's adapters); serve adapters "
                                  "with --lora-modules, or use --api-server-count 1")


def _run_engine_core(args: argparse.Namespace, manager, tokenizer, name: str, count: int, limits) -> int:
    """This process as the engine core of `count` API server processes (serving/engine_core.py)."""
    import logging

    from gpuformers.serving.engine_core import EngineCore, listening_socket, spreads_connections

    # gpuformers' own lines at --log-level (other libraries' at warning), each naming the process that wrote it
    logging.basicConfig(format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    logging.getLogger("gpuformers").setLevel(args.log_level.upper())
    # Linux: the port held by a bound socket here, each API server listening on its own (SO_REUSEPORT) so that the
    # kernel spreads the connections; elsewhere one listening socket, inherited by all
    spread = spreads_connections()
    sock = listening_socket(args.host, args.port, None if spread else limits.backlog, reuse_port=spread)
    print(f"gpuformers serve: the engine in this process (pid {os.getpid()}), HTTP in {count} API server processes "
          f"(--api-server-count)", flush=True)
    server_config = {"model_name": name, "max_model_len": args.max_model_len,
                     "max_pending": args.max_pending, "tool_call_parser": args.tool_call_parser,
                     "reasoning_parser": args.reasoning_parser, "log_level": args.log_level,
                     "shutdown_timeout": args.shutdown_timeout, "host": args.host, "backlog": limits.backlog,
                     "limits": [limits.header_timeout, limits.keep_alive_timeout, limits.max_connections]}
    code = EngineCore(manager, tokenizer, count, sock, server_config, args.api_key).serve()
    if code:
        sys.exit(code)
    return 0


def _run_embed(args: argparse.Namespace, name: str, processes: int) -> int:
    """Serve args.model's embeddings (serving/embedding_app.py) until Ctrl-C or SIGTERM."""
    if processes > 1 or (args.tensor_parallel_size or 1) > 1:
        raise ValueError("--task embed runs in one process; drop --tensor-parallel-size and torchrun")
    if args.model is None:
        raise ValueError("--task embed needs an embedding model, e.g. gpuformers serve Qwen/Qwen3-Embedding-0.6B "
                         "--task embed")
    if (args.api_server_count or 1) > 1:
        raise NotImplementedError("--api-server-count > 1 with --task embed is not implemented: the embedding server "
                                  "runs in one process; drop --api-server-count")
    if args.lora_modules or args.allow_runtime_lora_updating:
        raise ValueError("LoRA adapters (--lora-modules, --allow-runtime-lora-updating) are served with --task "
                         "generate only; drop them for --task embed")
    from gpuformers.serving.embedding_app import build_embedding_app
    from gpuformers.serving.embeddings import load_embedder, parse_hf_overrides
    from gpuformers.serving.server import serve_app

    from gpuformers.models.command_line import kernel_options

    kernels = kernel_options(args)  # its errors before the load
    embedder = load_embedder(args.model, args.dtype, args.device, args.quantization, args.pooling, args.normalize,
                             args.max_model_len, parse_hf_overrides(args.hf_overrides))
    if args.attn_implementation:
        if kernels.get("allow_all_kernels") and "/" in args.attn_implementation:
            from gpuformers.layers.flash_attention import register_hub_attention

            register_hub_attention(args.attn_implementation, allow_all_kernels=True)
        embedder.model.set_attn_implementation(args.attn_implementation)
    if kernels.get("use_kernels"):
        from gpuformers.kernels.mapping import kernelize

        kernelize(embedder.model, kernel_config=kernels.get("kernel_config"))
    print(f"gpuformers serve: embedding model {name} on {embedder.model.device} (pooling: "
          f"{embedder.pooling.source}; {embedder.hidden_size} dimensions, inputs up to {embedder.max_model_len} "
          f"tokens); listening on http://{args.host}:{args.port}/v1", flush=True)
    serve_app(build_embedding_app(embedder, name, args.api_key), args.host, args.port, args.log_level,
              args.shutdown_timeout, _connection_limits(args))
    return 0


def _connection_limits(args: argparse.Namespace):
    """--header-timeout, --timeout-keep-alive and --max-connections as a connections.ConnectionLimits, checked
    against the open-file limit the server will have."""
    from gpuformers.serving.connections import ConnectionLimits, raise_open_file_limit

    raise_open_file_limit()
    return ConnectionLimits(args.header_timeout, args.timeout_keep_alive, args.max_connections).resolved()


def _lora_modules(values: list[str] | None) -> dict[str, str]:
    """--lora-modules NAME=FOLDER ... as {name: folder}."""
    adapters: dict[str, str] = {}
    for value in values or []:
        name, _, folder = value.partition("=")
        if not name or not folder:
            raise ValueError(f"--lora-modules {value!r} must be NAME=FOLDER, e.g. --lora-modules sql=./sql-lora")
        if name in adapters:
            raise ValueError(f"--lora-modules names {name!r} twice; give each adapter its own name")
        adapters[name] = folder
    return adapters


def _restart_under_torchrun(processes: int) -> int:
    """Run this same command as `processes` torchrun processes (this one becomes their torchrun agent); returns
    when they have ended: 0 after SIGTERM / Ctrl-C, which the agent passes on to them (graceful shutdown)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    argv = ["--standalone", f"--nproc_per_node={processes}", "-m", "gpuformers", *sys.argv[1:]]
    print(f"gpuformers serve: starting {processes} tensor-parallel processes (torchrun {' '.join(argv)})",
          flush=True)
    try:
        torchrun(argv)
    except SignalException:  # the agent stopped the processes on our signal
        pass
    return 0


def _follow(manager) -> NoReturn:
    """A process other than 0: run the engine with process 0's until its engine stops (after its graceful
    shutdown), whatever signal torchrun passes on meanwhile; then end the process."""
    import signal

    from gpuformers.distributed import exit_process

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    manager.follow()
    exit_process(0)


def _drop_unhonoured_defaults(model) -> None:
    """Reset the fields of the model's generation config that the engine cannot honour, saying which."""
    from gpuformers.engine.config import unhonoured_fields
    from gpuformers.generation.config import GenerationConfig

    config = model.generation_config
    dropped = unhonoured_fields(config) if config is not None else []
    if dropped:
        defaults, config = GenerationConfig(), config.copy()
        for name in dropped:
            setattr(config, name, getattr(defaults, name))
        model.generation_config = config
        print(f"gpuformers serve: warning: the model's generation_config.json sets {', '.join(dropped)}, which the "
              f"continuous batching engine does not implement; serving without {'them' if len(dropped) > 1 else 'it'}",
              file=sys.stderr, flush=True)
