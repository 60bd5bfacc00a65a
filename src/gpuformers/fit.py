"""`gpuformers fit MODEL`: will a model fit on these GPUs, and how: from config.json only (or a GGUF file's header),
before any weight is downloaded.

    config --meta-device model--> weights (exact: the tensors our loader allocates, tied ones once)
           --shapes-->            KV cache per token = layers x 2 (k and v) x kv_heads x head_dim x bytes
                                  activations of one prefill = tokens x (largest transient of one decoder layer)
    devices (free memory now, or --max-memory) --> the first of: the roomiest GPU, all GPUs (device_map="auto"),
                                  int8, nf4, GPUs + CPU offload, + disk, that holds the weights; for each, the longest
                                  context at --batch and the largest batch at --context that fit next to them

The KV cache and the activations share what the weights leave free: a prompt of N tokens in a batch of B needs
B x N x (KV per token + activations per token). A model with mamba layers (Mamba2, Nemotron-H) keeps keys and values
only in its attention layers, and B x its recurrent state (a fixed size per sequence) besides; its activations are
its scan's. Activations assume an attention backend that does not build the
(seq x seq) score matrix (sdpa's flash / memory-efficient kernels on a GPU); "eager" needs B x heads x N^2 more.
A GPU keeps 5% of its free memory (and 512 MiB at least) for the CUDA context, the allocator and kernels' workspace.
A GGUF file is sized as from_pretrained(gguf_file=) loads it: dequantized (float32 unless --dtype says otherwise) onto
one device, and quantized after that, so its unquantized weights must fit there first; nothing is offloaded.
`--train-processes N` adds what training keeps per GPU under DDP and ZeRO-1/2/3 (training/strategy_memory.py).

Offers: FitOption, FitReport, weight_bytes, kv_bytes_per_token, activation_bytes_per_token, state_bytes_per_sequence,
fit_report,
read_model_config, add_fit_arguments, run_fit.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuformers.sizes import format_size

HEADROOM = 0.05
MIN_HEADROOM = 512 * 2**20
# Bytes per weight and per group for quantized Linear layers (decoder layers only; embeddings and lm_head stay):
# int8: one byte + one float32 scale per output row; nf4: half a byte + one float32 absmax per 64 weights.
QUANTIZATIONS = {"int8": (1.0, None), "nf4": (0.5, 64)}
_QUANTIZATION_CONFIGS = {"int8": "BitsAndBytesConfig(load_in_8bit=True)",
                         "nf4": 'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")'}
_QUANTIZATION_FLAGS = {"int8": "bnb-8bit", "nf4": "bnb-4bit"}  # the same configs as --quantization of chat / serve


@dataclass
class FitOption:
    name: str  # "1 GPU", "4 GPUs", "4 GPUs + CPU offload", ...
    device_map: str  # what to pass to from_pretrained
    dtype: str
    quantization: str | None
    weights_bytes: int
    fits: bool
    max_context: int = 0  # at the requested batch
    max_batch: int = 0  # at the requested context
    note: str = ""


@dataclass
class FitReport:
    model: str
    parameters: int
    dtype: str
    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int
    context: int
    batch: int
    devices: dict[str, int]  # device -> usable bytes
    options: list[FitOption] = field(default_factory=list)
    gguf_file: str | None = None  # the file's name when `model` is the path of a GGUF file
    state_bytes_per_sequence: int = 0  # a model with mamba layers: its recurrent state, whatever the length

    @property
    def recommended(self) -> FitOption | None:
        """The first option (the fastest) that holds the weights and the requested context x batch."""
        return next((o for o in self.options if o.fits and o.max_batch >= self.batch), None)


def _meta_model(config):
    from gpuformers.models.modeling import skip_init
    from gpuformers.models.registry import model_class_for

    with torch.device("meta"), skip_init():
        return model_class_for(config)(config)


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of every parameter and persistent buffer as the loader allocates them (a tied tensor once)."""
    total, seen = 0, set()
    for name, module in model.named_modules():
        quantized = quantization is not None and isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
        for attr, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None or id(tensor) in seen or attr in module._non_persistent_buffers_set:
                continue
            seen.add(id(tensor))
            if quantized and attr == "weight":
                per_weight, group = QUANTIZATIONS[quantization]
                scales = tensor.shape[0] if group is None else -(-tensor.numel() // group)
                total += int(tensor.numel() * per_weight) + scales * 4
            else:
                total += tensor.numel() * (dtype.itemsize if tensor.is_floating_point() else tensor.element_size())
    return total


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer (DynamicCache keeps every token, sliding windows included)."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize


def state_bytes_per_sequence(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The recurrent state one sequence keeps (generation/state_cache.py), whatever its length: per mamba mixer the
    conv state (conv_dim x (conv_kernel - 1), in the model dtype) and the SSM state (heads x head_dim x state_size,
    float32)."""
    from gpuformers.layers.mamba2 import Mamba2Mixer  # here: the layer classes are only needed for these models

    return sum(m.state_bytes(dtype) for m in model.modules() if isinstance(m, Mamba2Mixer))


def _attention_kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Keys and values of one token in the attention layers of a hybrid model (its other layers keep none)."""
    return sum(2 * m.num_kv_heads * m.head_dim * dtype.itemsize for m in model.modules() if hasattr(m, "attention_fn"))


def _mixer_activation_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The largest transient of one mamba mixer per prompt token in a prefill (an estimate of its torch scan):
    in_proj's output and the conv window and output in the model dtype; in float32 x, x * dt, the output, the D term
    and the gated norm's input (5 x intermediate), B and C repeated per head (2 x heads x state_size), and the
    chunked scan's (chunk x chunk) matrices per head, a row of each per token (4 x heads x chunk_size: the masked
    steps, their sums, the decay, the scores)."""
    from gpuformers.layers.mamba2 import Mamba2Mixer

    def per_token(m: Mamba2Mixer) -> int:
        model_dtype = m.in_proj.out_features + 2 * m.conv_dim
        float32 = 5 * m.intermediate_size + 2 * m.num_heads * m.state_size + 4 * m.num_heads * m.chunk_size
        return model_dtype * dtype.itemsize + float32 * 4

    return max((per_token(m) for m in model.modules() if isinstance(m, Mamba2Mixer)), default=0)


def activation_bytes_per_token(config, dtype: torch.dtype) -> int:
    """The largest transient of one decoder layer per prompt token, in a prefill (one layer is alive at a time).

    attention: residual + normed (2 x hidden), q/k/v and their rotary copies (2 x (heads + 2 kv_heads) x head_dim),
    attention output (heads x head_dim), the cache's concatenated copy of this layer's k/v (2 kv_heads x head_dim);
    MLP: residual + normed (2 x hidden), gate, up, act(gate), act(gate) x up (4 x intermediate); plus cos/sin
    (float32, 2 x head_dim) shared by all layers.
    """
    hidden, heads, kv, head_dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = 2 * hidden + 2 * (heads + 2 * kv) * head_dim + heads * head_dim + 2 * kv * head_dim
    mlp = 2 * hidden + 4 * config.intermediate_size
    return max(attention, mlp) * dtype.itemsize + 2 * head_dim * 4


def _usable(free: int, gpu: bool) -> int:
    return max(0, free - max(int(free * HEADROOM), MIN_HEADROOM)) if gpu else free


def measured_devices(cuda: Any = None) -> dict[str, int]:
    """Free bytes per visible GPU ("cuda:0", ...) and 90% of the CPU's available memory ("cpu")."""
    from gpuformers.loading.device_plan import available_memory

    return {(f"cuda:{k}" if isinstance(k, int) else k): v for k, v in available_memory(cuda).items()}


def parse_devices(text: str) -> dict[str, int]:
    """--max-memory "0=24GiB,1=24GiB,cpu=64GiB" -> {"cuda:0": ..., "cuda:1": ..., "cpu": ...}."""
    from gpuformers.loading.device_plan import parse_max_memory

    pairs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f'--max-memory entry "{item}" is not DEVICE=SIZE; write e.g. "0=24GiB,cpu=64GiB"')
        key = key.strip()
        pairs[int(key) if key.isdigit() else key] = value.strip()
    return {(f"cuda:{k}" if isinstance(k, int) else k): v for k, v in parse_max_memory(pairs).items()}


def _capacity(budget: int, per_token: int, context: int, batch: int, limit: int | None,
              per_sequence: int = 0) -> tuple[int, int]:
    """(longest context at `batch`, largest batch at `context`) that `budget` bytes hold, each sequence taking
    `per_sequence` bytes whatever its length (a recurrent state) and `per_token` per token; `limit` caps the context
    (None: nothing does)."""
    if budget <= 0:
        return 0, 0
    longest = max(0, budget // max(batch, 1) - per_sequence) // per_token
    if limit is not None:
        longest = min(limit, longest)
    return int(longest), int(budget // (per_token * max(context, 1) + per_sequence))


def fit_report(config, devices: dict[str, int], *, dtype: torch.dtype, context: int = 4096, batch: int = 1,
               model_name: str = "", gguf_file: str | None = None) -> FitReport:
    """Size the model from `config` and try each placement on `devices` (usable bytes per device). With `gguf_file`,
    only the placements a GGUF file loads into: one device, quantized after loading."""
    model = _meta_model(config)
    weights = weight_bytes(model, dtype)
    if getattr(model, "is_stateful", False):  # mamba layers: a state per sequence, keys only in attention layers
        state = state_bytes_per_sequence(model, dtype)
        kv = _attention_kv_bytes_per_token(model, dtype)
        act = max(_mixer_activation_bytes_per_token(model, dtype),
                  activation_bytes_per_token(config, dtype) if kv else 0)
    else:
        state, kv, act = 0, kv_bytes_per_token(config, dtype), activation_bytes_per_token(config, dtype)
    per_token = kv + act
    logits = batch * config.vocab_size * 4  # float32 logits of the last position
    limit = model.position_limit  # None: no positions to run out of (a state-space model)
    gpus = [_usable(v, True) for k, v in devices.items() if k.startswith("cuda")]
    # one GPU: the one with the most room, not cuda:0, which another process may fill
    roomiest = max((k for k in devices if k.startswith("cuda")), key=lambda k: devices[k], default=None)
    cpu = devices.get("cpu", 0)
    report = FitReport(model_name, sum(p.numel() for p in model.parameters()), str(dtype).removeprefix("torch."),
                       weights, kv, act, context, batch, dict(devices), gguf_file=gguf_file,
                       state_bytes_per_sequence=state)
    name = str(dtype).removeprefix("torch.")
    one_device = "a GGUF file loads onto one device, without offload"

    def add(label, device_map, quantization, weights_here, room, note=""):
        budget = room - weights_here - logits
        longest, largest = _capacity(budget, per_token, context, batch, limit, state)
        if budget > 0 and largest < batch:
            note = f"holds the weights, not {context} tokens x batch {batch}" + (f"; {note}" if note else "")
        fits = budget > 0 and longest > 0
        if gguf_file and quantization and weights + logits > room:  # dequantized whole before it is quantized
            fits, note = False, f"a GGUF file is quantized after loading: its {format_size(weights)} must fit first"
        report.options.append(FitOption(label, device_map, name, quantization, weights_here, fits, longest, largest,
                                        note))

    def refuse_for_gguf(label, device_map):
        report.options.append(FitOption(label, device_map, name, None, weights, False, note=one_device))

    if gpus:
        many = len(gpus) > 1 and not gguf_file
        add("1 GPU", f'"{roomiest}"', None, weights, _usable(devices[roomiest], True))
        if many:
            add(f"{len(gpus)} GPUs", '"auto"', None, weights, sum(gpus))
        for quantization in QUANTIZATIONS:
            quantized = weight_bytes(model, dtype, quantization)
            add(f"{len(gpus) if many else 1} GPU{'s' if many else ''}, {quantization}",
                '"auto"' if many else f'"{roomiest}"', quantization, quantized,
                sum(gpus) if many else _usable(devices[roomiest], True),
                f"quantization_config={_QUANTIZATION_CONFIGS[quantization]}")
        if gguf_file:
            refuse_for_gguf(f"GPU{'s' if len(gpus) > 1 else ''} + CPU offload", '"auto"')
            return report
        # Offload: the weights that do not fit on the GPUs wait on the CPU and stream in per layer; the GPUs keep
        # room for the KV cache and activations of the requested context and batch.
        on_gpus = max(0, sum(gpus) - (per_token * context + state) * batch - logits)
        spill = max(0, weights - on_gpus)
        note = f"{spill / 2**30:.1f} GiB of weights on the CPU: slow (streamed in every forward)"
        fits_cpu = spill <= cpu
        report.options.append(FitOption(f"{len(gpus)} GPU{'s' if many else ''} + CPU offload", '"auto"', name, None,
                                        weights, fits_cpu and on_gpus > 0, *_capacity(
                                            sum(gpus) - min(weights, on_gpus) - logits, per_token, context, batch,
                                            limit, state),
                                        note if fits_cpu else "the CPU cannot hold the rest: use disk"))
        report.options.append(FitOption("GPUs + CPU + disk offload", '"auto" with offload_folder=', name, None,
                                        weights, on_gpus > 0, *_capacity(sum(gpus) - min(weights, on_gpus) - logits,
                                                                        per_token, context, batch, limit, state),
                                        "very slow: weights are read from disk in every forward"))
    else:
        add("CPU", '"cpu"', None, weights, cpu, "no GPU is visible: runs on the CPU (slow)")
        if gguf_file:
            refuse_for_gguf("CPU + disk offload", '"auto" with offload_folder=')
        else:
            add("CPU + disk offload", '"auto" with offload_folder=', None, weights, cpu + weights,
                "very slow: weights are read from disk in every forward")
    return report


# ------------------------------------------------------------------------------------------------------- CLI


def format_report(report: FitReport) -> str:
    lines = [f"{report.model}: {report.parameters / 1e9:.2f} B parameters in {report.dtype}",
             f"  weights            {format_size(report.weights_bytes)}",
             f"  KV cache           {report.kv_bytes_per_token / 2**10:.1f} KiB per token "
             f"({format_size(report.kv_bytes_per_token * report.context * report.batch)} for {report.context} "
             f"tokens x batch {report.batch})",
             f"  activations        {report.activation_bytes_per_token / 2**10:.1f} KiB per prompt token "
             f"({format_size(report.activation_bytes_per_token * report.context * report.batch)} for a "
             f"{report.context}-token prefill x batch {report.batch})",
             *([f"  recurrent state    {format_size(report.state_bytes_per_sequence)} per sequence, whatever its "
                f"length ({format_size(report.state_bytes_per_sequence * report.batch)} for batch {report.batch})"]
               if report.state_bytes_per_sequence else []),
             "  devices            " + ", ".join(f"{k} {format_size(v)}" for k, v in report.devices.items()), ""]
    rows = [["option", "device_map", "weights", "fits", f"max context (batch {report.batch})",
             f"max batch ({report.context} tokens)", "note"]]
    for o in report.options:
        rows.append([o.name, o.device_map, format_size(o.weights_bytes), "yes" if o.fits else "no",
                     str(o.max_context) if o.fits else "-", str(o.max_batch) if o.fits else "-", o.note])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    best = report.recommended
    lines.append("")
    if best is None:
        lines.append("Nothing here holds this model with the requested context: add GPUs, or use a smaller model.")
    else:
        extra = f", quantization_config={_QUANTIZATION_CONFIGS[best.quantization]}" if best.quantization else ""
        source = f"..., gguf_file={report.gguf_file!r}" if report.gguf_file else "..."
        lines.append(f"Use: from_pretrained({source}, dtype={best.dtype!r}, device_map={best.device_map}{extra})")
        if "offload_folder" not in best.device_map:  # the CLI has no flag for an offload folder
            device = best.device_map.strip('"')
            flags = f"--device {device} --dtype {best.dtype}"
            flags += f" --quantization {_QUANTIZATION_FLAGS[best.quantization]}" if best.quantization else ""
            lines.append(f" or: gpuformers chat --model {report.model} {flags}")
    return "\n".join(lines)


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hub id, a local folder or a .gguf file; only config.json (or the GGUF "
                                      "file's header) is read, no weights")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's, bfloat16 on a GPU), float16, ...")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence to plan for (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="sequences at once to plan for (default 1)")
    parser.add_argument("--max-memory", metavar="LIST", default=None,
                        help='plan for other devices than these: "0=24GiB,1=24GiB,cpu=64GiB"')
    parser.add_argument("--json", action="store_true", help="print JSON for machines instead of text")
    parser.add_argument("--train-processes", type=int, metavar="N", default=None,
                        help="also the memory per GPU of training over N data-parallel processes under DDP and "
                             "ZeRO-1/2/3 (FSDP2), Adam in mixed precision")


def _is_gguf(path: Path) -> bool:
    """A .gguf path (which read_gguf checks), or a file that starts as GGUF files do whatever its name."""
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


def read_model_config(model: str):
    """(ModelConfig, the dtype "auto" loads in, GGUF file name or None) from config.json alone, or a GGUF file's
    metadata; a Hub id missing from the cache says how to get just config.json."""
    from gpuformers.hub import resolve_model_dir
    from gpuformers.models.config import ModelConfig

    path = Path(model).expanduser()
    if _is_gguf(path):
        from gpuformers.loading.gguf import read_gguf

        # from_pretrained(gguf_file=) dequantizes into float32 when dtype is "auto" (models/auto.py)
        return ModelConfig.from_dict(read_gguf(path).config), "float32", path.name
    try:
        folder = resolve_model_dir(model, ["config.json"])
    except FileNotFoundError as error:
        from huggingface_hub.errors import LocalEntryNotFoundError

        if not isinstance(error.__cause__, LocalEntryNotFoundError):
            raise
        raise FileNotFoundError(
            f"{error} `gpuformers fit` reads only the model's config.json (a few KB, no weights): "
            f"`hf download {model} config.json` fetches just that file into the HF cache, after which this command "
            f"runs offline; or put that one file in a folder and run `gpuformers fit FOLDER`.") from error
    if not (folder / "config.json").is_file() and (ggufs := sorted(folder.glob("*.gguf"))):
        raise FileNotFoundError(f"{folder} has no config.json but holds {', '.join(p.name for p in ggufs)}: pass "
                                f"the GGUF file itself, e.g. `gpuformers fit {ggufs[0]}`")
    config = ModelConfig.from_file(folder / "config.json")
    return config, config.dtype, None


def run_fit(args: argparse.Namespace) -> int:
    from gpuformers.device import parse_dtype, resolve_dtype

    config, checkpoint_dtype, gguf_file = read_model_config(args.model)
    devices = parse_devices(args.max_memory) if args.max_memory else measured_devices()
    on_gpu = any(k.startswith("cuda") for k in devices)
    if args.max_memory is None:  # these GPUs: the one dtype rule of gpuformers
        dtype = resolve_dtype(args.dtype, checkpoint_dtype=checkpoint_dtype, device="auto" if on_gpu else "cpu")
    else:  # GPUs that may not be here: the checkpoint's dtype, else bfloat16 on GPUs
        chosen = parse_dtype(args.dtype)
        stored = parse_dtype(checkpoint_dtype) if checkpoint_dtype else "auto"
        dtype = chosen if chosen != "auto" else stored if stored != "auto" else torch.bfloat16 if on_gpu else torch.float32
    report = fit_report(config, devices, dtype=dtype, context=args.context, batch=args.batch, model_name=args.model,
                        gguf_file=gguf_file)
    training = None
    if args.train_processes is not None:
        from gpuformers.training.strategy_memory import format_strategy_memory, strategy_memory

        training = [{**asdict(row), "total_bytes": row.total_bytes}
                    for row in strategy_memory(report.parameters, args.train_processes)]
    if args.json:
        print(json.dumps({**asdict(report), "recommended": report.recommended and asdict(report.recommended),
                          **({"training": training} if training is not None else {})}, indent=2))
    else:
        print(format_report(report))
        if training is not None:
            print("\n" + format_strategy_memory(report.parameters, args.train_processes))
    return 0 if report.recommended is not None else 1
