"""The steps of `from_pretrained`, each a small function `step(options, state)`: it reads the call's LoadOptions
(models/auto.py; no step changes them) and what earlier steps left in the LoadState, and adds its own part.
models/auto.py runs them in the order of its CHECKPOINT_STEPS and GGUF_STEPS (drawn in its docstring and in
docs/loading.md).

Why this order: devices come first because tp_plan joins the process group and the GPU decides dtype="auto"
(a GPU without bfloat16 loads float16); the class is known only once config.json is read, and a head's settings
change the config before the model is built; layers are quantized on the meta device, before any weight is read,
so each tensor streams straight into its quantized layer (a GGUF file is dequantized on load, so it is quantized
after); the device plan needs the quantized layers' sizes; tied weights, rotary buffers and the attention backend
need the loaded tensors; device_map's hooks and tensor-parallel slicing go on the finished model; kernels replace
modules last, as they find them; an adapter wraps the model as users get it.

Under a DeepSpeed ZeRO-3 config in force (TrainingArguments(deepspeed=<stage 3>) made before from_pretrained:
distributed.zero3_init) the model is built partitioned, as transformers builds it: build_on_meta builds it inside
deepspeed.zero.Init (each parameter made on the device and split over the processes as its module's __init__ ends,
so the whole model is never in one process) instead of on the meta device, and load_weights fills each parameter in
place: gathered whole for a moment in every process (deepspeed.zero.GatheredParameters, a collective), process 0
copies the checkpoint's tensor in, and DeepSpeed broadcasts it from process 0 and keeps each process's partition.
Process 0 alone reads the file: it is read once, not once per process from what is often a shared filesystem or Hub
cache; the broadcast costs about what the read does; and only DeepSpeed's public API is used (how a partition is
laid out is its own). device_map, quantization (asked for or in config.json), tp_plan, a GGUF file and a LoRA
adapter folder are refused then (NotImplementedError naming the combination).

Offers: LoadState; the steps choose_devices, resolve_files, read_config, pick_class, find_weights, choose_dtype,
build_on_meta, quantize, plan_devices, load_weights, finish, dispatch, add_generation_config, split_tensor_parallel,
apply_kernels, load_adapter, and for GGUF read_gguf, place_gguf, load_gguf_weights, quantize_loaded; gguf_path
(gguf_file= as a path, which AutoTokenizer uses too); build_partitioned (ZeRO-3, which from_config uses too).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from gpuformers import distributed
from gpuformers.hub import CONFIG_PATTERNS, WEIGHT_PATTERNS, HubKwargs, resolve_model_dir
from gpuformers.lora.config import CONFIG_NAME as ADAPTER_CONFIG_NAME, LoraConfig
from gpuformers.models.config import ModelConfig
from gpuformers.models.heads import (BaseModelHead, TaskModel, base_model_class, causal_lm_class, checkpoint_view,
                                     sequence_classification_class)
from gpuformers.models.modeling import skip_init
from gpuformers.models.registry import model_class_for

if TYPE_CHECKING:
    from gpuformers.models.auto import LoadOptions

logger = logging.getLogger(__name__)

_DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class LoadState:
    """What a load has found and built so far. Each field is filled by the step named beside it."""

    name_or_path: str | os.PathLike  # what the model is named after: the id or folder, an adapter's base, a GGUF path
    config: ModelConfig | None = None  # the caller's config=, else read_config / read_gguf
    tp_device: torch.device | None = None  # choose_devices, under tp_plan: this process's device
    device: torch.device | str | dict | None = None  # choose_devices: one device, or a strategy / map until planned
    folder: Path | None = None  # resolve_files: the checkpoint folder
    adapter_folder: Path | None = None  # resolve_files: a LoRA adapter's folder, loaded onto the model last
    gguf: object = None  # read_gguf: the GGUFCheckpoint
    cls: type | None = None  # pick_class
    files: object = None  # find_weights: the CheckpointFiles
    dtype: torch.dtype | None = None  # choose_dtype
    model: torch.nn.Module | None = None  # build_on_meta, then filled in place by the later steps
    quantization: object = None  # quantize: the quantization config in force, or None
    plan: dict | None = None  # plan_devices: module name -> device, for several devices
    offload: object = None  # plan_devices: where disk-offloaded tensors go
    info: object = None  # load_weights: the LoadingInfo (a GGUF load has none)
    zero3: distributed.ZeroInit | None = None  # choose_devices: the ZeRO-3 config in force (built partitioned)

    def result(self, output_loading_info: bool):
        # A GGUF load returns the model alone, even with output_loading_info=True (it has no loading info)
        return (self.model, self.info) if output_loading_info and self.info is not None else self.model


# ---- steps shared by both paths ----

def choose_devices(options: LoadOptions, state: LoadState) -> None:
    """tp_plan: join the process group and load on the CPU; device_map: one torch.device, or a strategy / per-module
    map kept for plan_devices."""
    state.zero3 = distributed.zero3_init()
    if state.zero3 is not None:  # ZeRO-3: each process keeps its partitions on its own device
        _refuse_under_zero3(options)
        state.device = state.zero3.device
        return
    device_map = options.device_map
    if options.tp_plan is not None or options.tp_size is not None:
        # Loaded on the CPU, then each process's slices go to its device (tensor_parallel.py)
        state.tp_device, device_map = _tensor_parallel_device(options.tp_plan, device_map, options.gguf_file), "cpu"
    state.device = _resolve_device_map(device_map)


def pick_class(options: LoadOptions, state: LoadState) -> None:
    """The model class, from the caller's class or head and config.json; a head then applies its settings
    (num_labels, ...) to the config, before the model is built from it."""
    state.cls = _pick_class(options.model_class, state.config, options.head)
    if options.task:
        state.config = state.cls.configure(state.config, **options.head_settings)


def choose_dtype(options: LoadOptions, state: LoadState) -> None:
    """dtype="auto" -> the checkpoint's (FP8 weights compute in bfloat16; GGUF is dequantized into float32), unless
    the device cannot run it."""
    from gpuformers.device import parse_dtype, resolve_dtype

    if state.gguf is not None:
        checkpoint_dtype = torch.float32
    else:
        checkpoint_dtype = parse_dtype(state.config.dtype) if state.config.dtype else state.files.first_floating_dtype()
        if checkpoint_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            checkpoint_dtype = torch.bfloat16
    # (under tp_plan the weights are read on the CPU but computed on tp_device: its GPU decides, as with device_map)
    state.dtype = resolve_dtype(options.dtype, checkpoint_dtype=checkpoint_dtype,
                                device=state.tp_device or state.device)


def build_on_meta(options: LoadOptions, state: LoadState) -> None:
    """The model on the meta device: no memory, no random init; the load creates each tensor once, filled. Under
    ZeRO-3, partitioned over the processes instead (deepspeed.zero.Init), its tensors unfilled until load_weights."""
    if state.zero3 is not None:
        state.model = build_partitioned(state.cls, state.config, state.zero3, state.dtype)
        return
    with torch.device("meta"), skip_init():
        state.model = state.cls(state.config)


def finish(options: LoadOptions, state: LoadState) -> None:
    """Tie weights, compute rotary buffers, pick the attention backend, eval()."""
    model = state.model
    model.tie_weights()
    model.reset_buffers(state.device)
    name = options.attn_implementation or "sdpa"
    if options.allow_all_kernels and "/" in name:  # a Hub attention kernel the user trusts explicitly
        from gpuformers.layers.flash_attention import register_hub_attention

        register_hub_attention(name, allow_all_kernels=True)
    model.set_attn_implementation(name)
    model.name_or_path = str(state.name_or_path)
    model.hf_device_map = {"": str(state.device)}
    state.model = model.eval()


def add_generation_config(options: LoadOptions, state: LoadState) -> None:
    """generation_config.json (or the GGUF file's, or one made from config.json); a head gets none, as in
    transformers, since it does not generate."""
    from gpuformers.generation.config import GenerationConfig

    if state.gguf is not None:
        state.model.generation_config = GenerationConfig.from_dict(state.gguf.generation_config)
    elif not options.task:
        path = state.folder / "generation_config.json"
        state.model.generation_config = (GenerationConfig.from_pretrained(path) if path.is_file()
                                         else GenerationConfig.from_model_config(state.config))


def apply_kernels(options: LoadOptions, state: LoadState) -> None:
    """Check the attention backend can run where the model is, then swap in Triton kernels for use_kernels=True."""
    model = state.model
    if options.attn_implementation in ("flash_attention_2", "flash_attention_3", "flash_attention_4"):
        from gpuformers.layers.flash_attention import check_backend_device

        check_backend_device(options.attn_implementation, model.device)
    if options.use_kernels:
        from gpuformers.kernels.mapping import Mode, kernelize

        kernelize(model, mode=Mode.TRAINING if model.training else Mode.INFERENCE, kernel_config=options.kernel_config)


# ---- a checkpoint folder ----

def resolve_files(options: LoadOptions, state: LoadState) -> None:
    """The local folder (the Hub's cache for an id); a LoRA adapter folder names its base model, whose folder is
    resolved in its place."""
    hub = HubKwargs(revision=options.revision, cache_dir=options.cache_dir, local_files_only=options.local_files_only,
                    token=options.token)
    folder = resolve_model_dir(state.name_or_path, CONFIG_PATTERNS + WEIGHT_PATTERNS + [ADAPTER_CONFIG_NAME], hub)
    if (folder / ADAPTER_CONFIG_NAME).is_file():  # a LoRA adapter: load its base model, then the adapter onto it
        if state.zero3 is not None:
            raise _zero3_refusal(f"the LoRA adapter folder {str(folder)!r}", "load its base model, then wrap it with "
                                 "get_peft_model or load the adapter after the Trainer is made")
        state.adapter_folder = folder
        if not (folder / "config.json").is_file():  # else the folder holds its base model too (transformers' rule)
            state.name_or_path = _adapter_base_model(folder)
            folder = resolve_model_dir(state.name_or_path, CONFIG_PATTERNS + WEIGHT_PATTERNS, hub)
    state.folder = folder


def read_config(options: LoadOptions, state: LoadState) -> None:
    if state.config is None:
        state.config = ModelConfig.from_file(state.folder / "config.json")


def find_weights(options: LoadOptions, state: LoadState) -> None:
    from gpuformers.loading.weights import CheckpointFiles

    state.files = CheckpointFiles.find(state.folder)


def quantize(options: LoadOptions, state: LoadState) -> None:
    """Swap the linear layers for quantized ones before any weight is read; a head's own layer stays float."""
    state.quantization = _quantize(state.model, state.config, options.quantization_config, state.dtype)
    if options.task:
        state.model.unquantize_head()


def plan_devices(options: LoadOptions, state: LoadState) -> None:
    """Several devices (a device_map strategy or per-module map): where each module goes, decided before loading so
    each tensor is read straight onto its device; the model's main device then stands for the map."""
    if isinstance(state.device, torch.device):
        return
    from gpuformers.loading.device_map import main_device, prepare_device_map

    state.plan, state.offload = prepare_device_map(state.model, state.device, max_memory=options.max_memory,
                                                   dtype=state.dtype, offload_folder=options.offload_folder)
    state.device = main_device(state.plan)


def load_weights(options: LoadOptions, state: LoadState) -> None:
    """Stream each checkpoint tensor into its final dtype and device; a head reports (and draws) what it lacked;
    FP8 layers become plain dequantized Linear layers."""
    from gpuformers.loading.weights import load_weights as load
    from gpuformers.quantization.config import finish_loading

    model = target = state.model
    place = state.plan
    if options.task:  # the checkpoint's keys may be a causal LM's, a classifier's or a bare model's (models/heads.py)
        target, rename_plan = checkpoint_view(model, state.files.keys())
        if state.plan is not None and rename_plan is not None:
            place = rename_plan(state.plan)
    state.info = load(target, state.files, dtype=state.dtype, device=place or state.device, offload=state.offload,
                      tied=model.tied_weights, ignore_missing=model.allowed_missing if options.task else (),
                      progress=options.progress, fill=_fill_partitioned if state.zero3 is not None else None)
    if options.task:
        # under ZeRO-3 the head's missing parameters are drawn whole (process 0's draw is kept)
        drawn = [target.get_parameter(name) for name in state.info.missing] if state.zero3 is not None else []
        with _gathered(drawn):
            _report_head_load(model, state.info, state.folder)
    state.quantization = finish_loading(model, state.quantization, state.info.unexpected)
    model.quantization_config = state.quantization


def dispatch(options: LoadOptions, state: LoadState) -> None:
    """device_map over several devices: the hooks that move activations between them (and read offloaded weights)."""
    if state.plan is None:
        return
    from gpuformers.loading.device_map import dispatch_model

    dispatch_model(state.model, state.plan, state.offload)
    state.model.hf_device_map = state.plan


def split_tensor_parallel(options: LoadOptions, state: LoadState) -> None:
    """tp_plan: keep this process's slices of each layer, on its device."""
    if state.tp_device is None:
        return
    from gpuformers.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(state.model, options.tp_plan, options.tp_size, device=state.tp_device)
    state.model.hf_device_map = {"": str(state.tp_device)}


def load_adapter(options: LoadOptions, state: LoadState) -> None:
    if state.adapter_folder is not None:
        state.model.load_adapter(state.adapter_folder, adapter_name=options.adapter_name)


# ---- a GGUF file ----

def read_gguf(options: LoadOptions, state: LoadState) -> None:
    """The file's header: its config (an HF family's config.json, rebuilt) and tensor table."""
    from gpuformers.loading.gguf import read_gguf as read

    path = gguf_path(state.name_or_path, options.gguf_file)
    state.gguf = read(path)
    state.config = ModelConfig.from_dict(state.gguf.config)
    state.name_or_path = path


def place_gguf(options: LoadOptions, state: LoadState) -> None:
    """A device_map strategy or map must put the whole GGUF model on one device."""
    if not isinstance(state.device, torch.device):
        state.device = _gguf_device(state.model, state.device, options.max_memory, state.dtype)


def load_gguf_weights(options: LoadOptions, state: LoadState) -> None:
    """Dequantize each tensor straight into its final dtype on the device."""
    from tqdm.auto import tqdm

    from gpuformers.loading.weights import assign_tensor

    model, checkpoint = state.model, state.gguf
    tied = model.tied_weights
    names = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in tied]
    available = set(checkpoint.tensor_names())
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(f"GGUF file {state.name_or_path} lacks tensors for: {', '.join(missing[:10])}")
    for name in tqdm(names, desc="Dequantizing GGUF tensors", disable=not options.progress):
        assign_tensor(model, name, checkpoint.load_tensor(name, dtype=state.dtype, device=state.device))


def quantize_loaded(options: LoadOptions, state: LoadState) -> None:
    """GGUF weights are dequantized on load: quantization_config= quantizes them after."""
    if options.quantization_config is not None:
        model = state.model
        model.quantization_config = _quantize(model, model.config, options.quantization_config, model.dtype,
                                              loaded=True)


# ---- helpers ----

def _refuse_under_zero3(options: LoadOptions) -> None:
    """What a model built partitioned by ZeRO-3 cannot be loaded with (yet)."""
    asked = {"device_map": options.device_map, "tp_plan": options.tp_plan, "tp_size": options.tp_size,
             "quantization_config": options.quantization_config, "gguf_file": options.gguf_file}
    for name, value in asked.items():
        if value is not None:
            raise _zero3_refusal(f"{name}={value!r}", "drop it" if name != "gguf_file" else
                                 "load a safetensors checkpoint")


def _zero3_refusal(what: str, fix: str) -> NotImplementedError:
    return NotImplementedError(
        f"from_pretrained with {what} while a DeepSpeed ZeRO-3 config is in force (TrainingArguments(deepspeed=...) "
        f"with zero_optimization.stage 3 made before from_pretrained, which builds the model partitioned over the "
        f"processes with deepspeed.zero.Init) is not supported; {fix}, or load the model before making the "
        f"TrainingArguments (it then loads whole and DeepSpeed partitions it when training starts)")


def build_partitioned(cls, config: ModelConfig, zero3: distributed.ZeroInit, dtype: torch.dtype,
                      initialize: Callable[[nn.Module], None] | None = None):
    """The model built inside deepspeed.zero.Init over the process group the Trainer will use: each module's
    parameters are made on the device and split over the processes as its __init__ ends (this process keeps
    1/world_size of each), left unfilled (skip_init) for load_weights to fill, or, with `initialize` (from_config),
    each module gathered, initialised by it and process 0's values kept (DeepSpeed wraps Module.apply inside Init).
    Its dtype: the config's fp16 / bf16 when it enables one (what DeepSpeed's engine casts a whole model to), else
    `dtype`. Buffers are recomputed on zero3.device afterwards (Init makes floating tensors in its own dtype)."""
    import deepspeed  # optional (the deepspeed extra): only a ZeRO-3 TrainingArguments sets zero3, and needs it

    if config.extra.get("quantization_config") is not None:
        raise _zero3_refusal(f"a quantized checkpoint ({config.extra['quantization_config'].get('quant_method')})",
                             "load an unquantized one")
    half = any(isinstance(zero3.config.get(key), dict) and zero3.config[key].get("enabled") is True
               for key in ("fp16", "bf16", "bfloat16"))
    if not half and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"DeepSpeed ZeRO-3 builds models in float32, float16 or bfloat16, not {dtype}; pass one of "
                         "them as dtype=")
    zero3.join()
    deepspeed.init_distributed()  # DeepSpeed's view of that group: its config reads the world size from it
    # dtype=None: the config's choice (its half precision, else float32); an explicit float32 would be read wrongly
    # (deepspeed 0.19 takes `dtype or float16 if the accelerator has float16 else ...`: bfloat16 on its CPU one)
    with deepspeed.zero.Init(config_dict_or_path=zero3.config,
                             dtype=None if half or dtype == torch.float32 else dtype):
        if initialize is None:
            with skip_init():
                model = cls(config)
        else:
            model = cls(config)
            model.apply(initialize)
    model.reset_buffers(zero3.device)
    return model


def _fill_partitioned(target, read) -> None:
    """load_weights' fill under ZeRO-3: the parameter gathered whole in every process (a collective, in the same
    order everywhere), process 0 copies the checkpoint's tensor in, and DeepSpeed broadcasts it from process 0 as the
    block ends, each process keeping its partition (why process 0 reads: the module docstring). A persistent buffer
    is not partitioned: every process reads its own (buffers are small)."""
    tensor = target.meta  # the model's own tensor; its shape is the whole one while gathered
    if not hasattr(tensor, "ds_id"):
        with torch.no_grad():
            tensor.copy_(read())
        return
    with _gathered([tensor]), torch.no_grad():
        if distributed.rank() == 0:
            tensor.copy_(read())


def _gathered(parameters: list):
    """ZeRO-3 `parameters` gathered whole in every process for the block, process 0's values kept in every
    process's partitions afterwards (DeepSpeed broadcasts them); none: nothing to do."""
    if not parameters:
        return contextlib.nullcontext()
    import deepspeed  # optional: present whenever a ZeRO-3 config is in force

    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=0)


def gguf_path(name_or_path, gguf_file) -> Path:
    """gguf_file= as a path: absolute, or inside the folder (or Hub repo) name_or_path names."""
    path = Path(gguf_file)
    if not path.is_absolute() and name_or_path not in (None, ""):
        folder = Path(name_or_path)
        if not folder.is_dir():
            folder = resolve_model_dir(name_or_path, [str(gguf_file)])
        path = folder / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    return path


def _resolve_device_map(device_map) -> torch.device | str | dict:
    """One device -> torch.device; a strategy ("auto", ...) or a per-module dict is kept for the planner."""
    from gpuformers.device import resolve_device

    if isinstance(device_map, str) and device_map in _DEVICE_MAP_STRATEGIES:
        return device_map
    if isinstance(device_map, dict) and set(device_map) != {""}:
        return device_map
    if device_map == {"": "disk"}:
        raise ValueError('device_map={"": "disk"} leaves nothing to run the model on; put some modules on "cpu"')
    return resolve_device(device_map)


def _tensor_parallel_device(tp_plan, device_map, gguf_file) -> torch.device:
    """The device a tensor-parallel process loads on (its own GPU, else the CPU), with the process group joined."""
    from gpuformers import distributed

    if tp_plan is None:
        raise ValueError('tp_size is only used with tp_plan; pass tp_plan="auto" too')
    if device_map is not None:
        raise ValueError("tp_plan and device_map cannot be combined: with tp_plan each process loads on its own "
                         "device (cuda:LOCAL_RANK, or the CPU); drop device_map")
    if gguf_file is not None:
        raise NotImplementedError(f"tp_plan={tp_plan!r} with a GGUF file is not supported; load a safetensors "
                                  "checkpoint")
    device = distributed.process_device()
    distributed.init_distributed(device, single=True)
    return device


def _adapter_base_model(adapter_folder: Path) -> str:
    """The base model an adapter folder names: adapter_config.json's base_model_name_or_path."""
    base = LoraConfig.from_pretrained(adapter_folder).base_model_name_or_path
    if not base:
        raise ValueError(f"{adapter_folder / ADAPTER_CONFIG_NAME} names no base model (base_model_name_or_path is "
                         f"{base!r}); load the base model with from_pretrained(base), then call "
                         f"model.load_adapter({str(adapter_folder)!r})")
    return base


def _quantize(model, config: ModelConfig, requested, dtype: torch.dtype, loaded: bool = False):
    """Swap the model's linear layers for quantized ones, when asked by the caller or by the checkpoint's
    config.json (a pre-quantized checkpoint, whose settings then win, as in transformers)."""
    from gpuformers.quantization.config import checkpoint_quantization, quantize_linear_layers

    # quantization_config stays a key of `extra`: transformers' PretrainedConfig has it only on quantized
    # checkpoints, so a field would write a null one into every config.json; quantization/ sets and drops it there
    quantization = checkpoint_quantization(config.extra.get("quantization_config"), requested)
    if quantization is None:
        return None
    swapped = quantize_linear_layers(model, quantization, dtype, loaded=loaded)
    logger.info("quantizing %d linear layers with %s", len(swapped), quantization.quant_method)
    config.extra["quantization_config"] = quantization.to_dict()  # save_pretrained writes it back
    return quantization


def _pick_class(model_class, config: ModelConfig, head=None):
    from gpuformers.models.modeling import PreTrainedModel

    if head is not None:
        return head(causal_lm_class(config.model_type))
    if model_class is not None and issubclass(model_class, TaskModel):
        return _pick_head_class(model_class, config)
    if model_class is None or model_class is PreTrainedModel:
        return model_class_for(config)
    expected = model_class_for(config)
    if not issubclass(model_class, expected) and not issubclass(expected, model_class):
        raise ValueError(
            f"{model_class.__name__}.from_pretrained was given a {config.architecture} checkpoint; "
            f"use AutoModelForCausalLM.from_pretrained or {expected.__name__}"
        )
    return model_class


def _pick_head_class(model_class, config: ModelConfig):
    """A head class asked to load a config (Qwen3ForSequenceClassification.from_pretrained): itself, or the same
    head on the config's family when that one subclasses its own (a Qwen3-MoE checkpoint)."""
    family = causal_lm_class(config.model_type)
    build = base_model_class if issubclass(model_class, BaseModelHead) else sequence_classification_class
    if issubclass(model_class.family, family):
        return model_class
    if issubclass(family, model_class.family):
        return build(family)
    auto = "AutoModel" if build is base_model_class else "AutoModelForSequenceClassification"
    raise ValueError(f"{model_class.__name__}.from_pretrained was given a {config.model_type!r} checkpoint; use "
                     f"{auto}.from_pretrained or {build(family).__name__}")


def _report_head_load(model, info, folder: Path) -> None:
    """Initialise the head's weights the checkpoint lacked (allowed_missing) and say so, as transformers does."""
    if info.missing:
        model.init_missing(info.missing)
        logger.warning("%s: %s not in the checkpoint %s: drawn at random (normal, std=%s); train the model before "
                       "using its outputs", type(model).__name__, ", ".join(info.missing), folder,
                       model.config.initializer_range)
    if info.unexpected:
        logger.info("%s: checkpoint tensors not used: %s", type(model).__name__, ", ".join(info.unexpected[:10]))


def _gguf_device(model, device_map, max_memory, dtype) -> torch.device:
    """The one device a GGUF file is dequantized onto for a device_map: where the map's plan puts the whole model
    (device_map="auto" on a machine whose only device is the CPU, or with a GPU that holds it all)."""
    from gpuformers.loading.device_map import main_device, plan_for

    plan = plan_for(model, device_map, max_memory=max_memory, dtype=dtype)
    places = sorted({f"cuda:{where}" if isinstance(where, int) else where for where in plan.values()})
    if len(places) > 1 or places == ["disk"]:
        raise NotImplementedError(
            f"device_map={device_map!r} places this GGUF model on {', '.join(places)}, but a GGUF file loads whole "
            f'onto one GPU or the CPU for now: pass one device (e.g. device_map="cuda:0"), and quantization_config= '
            f"if the model does not fit there")
    return main_device(plan)
