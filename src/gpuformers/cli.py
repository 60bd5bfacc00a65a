"""`gpuformers <verb>`: the command line, a table of verbs -> "module:function".

A verb's module is imported only when that verb runs, so `gpuformers env` starts without the model code and
`gpuformers --help` is instant. Adding a verb is one entry in VERBS, e.g.:

    "generate": Verb("generate text from a prompt", 'gpuformers generate Qwen/Qwen3-0.6B "Hello"',
                     "gpuformers.generate_cli:run", "gpuformers.generate_cli:add_arguments"),

`run(args: argparse.Namespace) -> int | None` does the work (None means exit code 0); the optional
`add_arguments(parser)` adds the verb's own flags. Common flags (`--gpus`) go before or after the verb and are
applied before the verb's module is imported, hence before CUDA can start.

The library's errors name its Python arguments (`device_map="cpu"`), but a verb's user typed flags: a verb's
`flags` say how its flags spell those arguments, and `main` prints an error with them (`for_cli`):

    or run on the CPU with device_map="cpu"   --generate-->   or run on the CPU with --device cpu

Offers: `Verb`, `VERBS`, `for_cli`, `main(argv)`, and the two verbs that live here: `run_env` and `run_doctor`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from typing import Any, Callable, NamedTuple

from gpuformers.device import DEVICE_FORMS
from gpuformers.sizes import format_size

Flags = tuple[tuple[str, str], ...]  # (regular expression of a Python spelling, re.sub replacement naming the flag)


class Verb(NamedTuple):
    summary: str  # one line for `gpuformers --help`
    example: str  # shown under the verb's --help
    run: str  # "module:function" taking the parsed args
    arguments: str | None = None  # "module:function" adding the verb's flags to its parser
    flags: Flags = ()  # the Python arguments its errors may name, as its flags spell them (for_cli)


# Python spellings of from_pretrained's arguments in the library's errors -> the flags that set them. Only whole
# spellings are matched (dtype=torch.float32, device_map="cpu"), so a sentence keeps its grammar.
_OFFLINE: Flags = ((r" or local_files_only=True", ""),)  # HF_HUB_OFFLINE=1, named beside it, is the CLI's switch
_DTYPE: Flags = ((r"\bdtype=torch\.(\w+)", r"--dtype \1"), (r"""\bdtype=(["'])(\w+)\1""", r"--dtype \2"),
                 (r"\bdtype=(?=[\s,;])", "--dtype"))
_GGUF_PATH: Flags = ((r"\bgguf_file=(?=[\s)])", "a path ending in .gguf"),)  # MODEL / --model takes the file itself
_DEVICE: Flags = ((r"""\bdevice_map=(["'])(cpu|cuda(?::\d+)?|auto)\1""", r"--device \2"),
                  (re.escape(DEVICE_FORMS), "cpu, cuda, cuda:N or auto"))
_QUANTIZATION: Flags = ((r"\bbits=8\b", "--quantization int8"), (r"\bbits=4\b", "--quantization int4"),
                        (r"\bquantization_config=(?=[\s,;)])", "--quantization"))
_KERNELS: Flags = ((r"from_pretrained\(\.\.\., allow_all_kernels=True\)", "--allow-all-kernels"),
                   (r"\buse_kernels=True\b", "--use-kernels"))  # models/command_line.py's kernel flags
_LOCAL_MODEL: Flags = _OFFLINE + _DTYPE + _GGUF_PATH + _DEVICE + _QUANTIZATION + _KERNELS  # generate_cli.py's
_ENGINE: Flags = tuple((rf"\b{name}=", f"{flag} ") for name, flag in (  # ContinuousBatchingConfig's fields
    ("max_memory_percent", "--gpu-memory-utilization"), ("block_size", "--block-size"), ("num_blocks", "--num-blocks"),
    ("max_batch_tokens", "--max-batch-tokens"), ("max_requests_per_batch", "--max-num-seqs")))
_SERVE: Flags = _LOCAL_MODEL + _ENGINE + ((r"""\btp_plan=(["'])auto\1""", "--tensor-parallel-size N"),
                                          (r"""\battn_implementation=(["'])(\w+)\1""", r"--attn-implementation \2"))
_FIT: Flags = _OFFLINE + _DTYPE + _GGUF_PATH + ((r"\bmax_memory\b", "--max-memory"),)
_TRAIN: Flags = _OFFLINE + _DTYPE + _KERNELS + (
    (r"""\bdevice_map=(["'])cpu\1""", "--cpu"), (r"\bbf16=True\b", "--bf16 true"),
    (r"\bfp16=True\b", "fp16 (what --bf16 auto picks on a GPU without bfloat16)"),
    (r" \(or gguf_file=[^)]*\)", ""))  # train takes no GGUF file


def for_cli(message: str, flags: Flags) -> str:
    """`message` with the Python arguments it names spelled as the flags that set them."""
    for pattern, flag in flags:
        message = re.sub(pattern, flag, message)
    return message


VERBS: dict[str, Verb] = {
    "env": Verb("show versions, CUDA and the GPUs as CUDA numbers them", "gpuformers env --json",
                "gpuformers.cli:run_env", "gpuformers.cli:add_json_argument"),
    "doctor": Verb("check the GPU setup and say how to fix what is wrong", "gpuformers --gpus 0,1 doctor",
                   "gpuformers.cli:run_doctor", "gpuformers.cli:add_json_argument"),
    "generate": Verb("answer one prompt with a local model, streaming the reply",
                     'gpuformers generate "What is the capital of France?"',
                     "gpuformers.generate_cli:run_generate", "gpuformers.generate_cli:add_generate_arguments",
                     _LOCAL_MODEL),
    "chat": Verb("chat with a local model in the terminal (/clear, /exit)", "gpuformers chat --temperature 0.7",
                 "gpuformers.generate_cli:run_chat", "gpuformers.generate_cli:add_chat_arguments", _LOCAL_MODEL),
    "fit": Verb("will a model fit these GPUs? weights, KV cache, best device_map",
                "gpuformers --gpus 0,1 fit Qwen/Qwen3-8B --context 32768 --batch 4\n"
                "  gpuformers fit ./SmolLM2-135M-Instruct.Q4_1.gguf --max-memory 0=8GiB,cpu=16GiB",
                "gpuformers.fit:run_fit", "gpuformers.fit:add_fit_arguments", _FIT),
    "train": Verb("fine-tune a model on a JSONL of text or chat rows (loss on assistant turns only)",
                  "gpuformers train --model Qwen/Qwen3-0.6B --data chats.jsonl --epochs 1 --lr 2e-5",
                  "gpuformers.training.cli:run_train", "gpuformers.training.cli:add_train_arguments", _TRAIN),
    "serve": Verb("serve a model over the OpenAI API (completions, chat, responses, streaming; embeddings with "
                  "--task embed) on the batching engine",
                  "gpuformers serve Qwen/Qwen3-0.6B --port 8000 --api-key secret",
                  "gpuformers.serving.cli:run_serve", "gpuformers.serving.cli:add_serve_arguments", _SERVE),
}


def _load(target: str) -> Callable[..., Any]:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def _add_common(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--gpus", metavar="LIST", default=default,
                        help='GPUs for this run only, as nvidia-smi numbers them: "0,2" (sets CUDA_VISIBLE_DEVICES '
                             'and CUDA_DEVICE_ORDER=PCI_BUS_ID before CUDA starts); "" runs on the CPU')


def _find_verb(argv: list[str]) -> str | None:
    """The first word that is not a flag or a flag's value, so that only that verb's module is imported."""
    tokens = iter(argv)
    for token in tokens:
        if token == "--gpus":
            next(tokens, None)
        elif not token.startswith("-"):
            return token
    return None


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser for all verbs; only `verb`'s own flags are loaded (its module is imported)."""
    parser = argparse.ArgumentParser(prog="gpuformers", description="Run, serve and train Hugging Face language "
                                     "models on NVIDIA GPUs.", epilog="example:\n  gpuformers env",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(parser, None)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name, entry in VERBS.items():
        sub = verbs.add_parser(name, help=entry.summary, description=entry.summary,
                               epilog=f"example:\n  {entry.example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        # SUPPRESS: a --gpus given before the verb must not be reset by the sub-parser's default
        _add_common(sub, argparse.SUPPRESS)
        if name == verb and entry.arguments:
            _load(entry.arguments)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpuformers` console script and of `python -m gpuformers`."""
    from gpuformers.device import select_gpus  # device.py imports torch lazily: CUDA cannot start here

    argv = sys.argv[1:] if argv is None else list(argv)
    verb = _find_verb(argv)
    parser = build_parser(verb if verb in VERBS else None)
    args = parser.parse_args(argv)
    if args.gpus is not None:
        try:
            select_gpus(args.gpus)
        except (ValueError, RuntimeError) as error:
            parser.error(str(error))
    try:
        result = _load(VERBS[args.verb].run)(args)
    except (FileNotFoundError, ValueError, NotImplementedError, RuntimeError) as error:
        # Errors a user can act on get one line, not a traceback (GPUFORMERS_DEBUG=1 shows the traceback).
        if os.environ.get("GPUFORMERS_DEBUG"):
            raise
        print(f"gpuformers {args.verb}: error: {for_cli(str(error), VERBS[args.verb].flags)}", file=sys.stderr)
        return 2
    return 0 if result is None else int(result)


# ------------------------------------------------------------------------------------------- env and doctor


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON for machines instead of text")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in [headers, *rows])


def format_env(report: dict[str, Any]) -> str:
    """The text `gpuformers env` prints for an env_report."""
    versions, env = report["versions"], report["environ"]
    names = {"python": "Python", "gpuformers": "gpuformers", "torch": "torch", "torch_cuda": "torch CUDA",
             "driver": "NVIDIA driver", "triton": "triton", "flash_attn": "flash-attn", "bitsandbytes": "bitsandbytes"}
    missing = {"torch_cuda": "none (CPU-only build)", "driver": "unknown (no nvidia-smi, no NVML)"}
    lines = [f"{label:<14}{versions[key] or missing.get(key, 'not installed')}" for key, label in names.items()]
    if report["torch_error"]:
        lines.append(f"import torch failed: {report['torch_error']}")
    order = env["CUDA_DEVICE_ORDER"]
    lines += ["", f"torch.cuda.is_available(): {report['cuda_available']}   device count: {report['device_count']}",
              f"CUDA_VISIBLE_DEVICES={'(not set)' if env['CUDA_VISIBLE_DEVICES'] is None else repr(env['CUDA_VISIBLE_DEVICES'])}"
              f"   CUDA_DEVICE_ORDER={order or '(not set: FASTEST_FIRST)'}"
              + (f"   (set by --gpus {report['gpus_flag']!r})" if report["gpus_flag"] is not None else ""), ""]
    if report["gpus"]:
        rows = [[f"cuda:{g['index']}", "?" if g["nvidia_smi_index"] is None else str(g["nvidia_smi_index"]), g["name"],
                 "{}.{}".format(*g["capability"]), format_size(g["total_memory"]),
                 format_size(g["free_memory"]), "yes" if g["bf16"] else "no", g["pci_bus_id"] or "?"]
                for g in report["gpus"]]
        lines.append(_table(["device", "nvidia-smi", "name", "capability", "total", "free", "bf16", "PCI bus id"], rows))
    else:
        lines.append("No CUDA GPU is visible: gpuformers runs on the CPU.")
    if report["nvidia"] and not report["gpus"]:
        rows = [[str(g["index"]), g["name"], format_size(g["total_memory"]), format_size(g["free_memory"]),
                 g["pci_bus_id"]]
                for g in report["nvidia"]["gpus"]]
        lines += ["", f"GPUs {report['nvidia']['source']} lists:",
                  _table(["nvidia-smi", "name", "total", "free", "PCI bus id"], rows)]
    if report.get("backends"):  # attention backends and kernels: whether each runs here (doctor.backend_report)
        rows = [[b["kind"], b["name"], "yes" if b["runs"] else "no", b["why"]] for b in report["backends"]]
        lines += ["", f"Backends and kernels on {report['backends'][0]['where']}:",
                  _table(["kind", "name", "runs", "why not / note"], rows)]
    return "\n".join(lines)


def run_env(args: argparse.Namespace) -> int:
    """`gpuformers env`: versions, CUDA, and the GPUs as CUDA numbers them."""
    from gpuformers.doctor import env_report

    report = env_report()
    print(json.dumps(report, indent=2) if args.json else format_env(report))
    return 0


def format_findings(findings: list[Any]) -> str:
    """The text `gpuformers doctor` prints: one line per check, then the fix under it."""
    lines = []
    for finding in findings:
        first, *rest = finding.message.split("\n")
        lines.append(f"[{finding.level}]".ljust(7) + f"{finding.check}: {first}")
        lines += ["       " + line for line in rest]
        if finding.fix:
            lines.append(f"       fix: {finding.fix}")
    failed = sum(f.level == "fail" for f in findings)
    warned = sum(f.level == "warn" for f in findings)
    lines.append(f"\n{failed} failed, {warned} warning(s)")
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> int:
    """`gpuformers doctor`: exit code 1 when a check fails (warnings alone: 0)."""
    from dataclasses import asdict

    from gpuformers.doctor import doctor, env_report

    findings = doctor(env_report())
    print(json.dumps([asdict(f) for f in findings], indent=2) if args.json else format_findings(findings))
    return 1 if any(f.level == "fail" for f in findings) else 0
