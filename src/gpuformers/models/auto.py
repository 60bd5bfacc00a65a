"""Entry points users call: AutoConfig, AutoModelForCausalLM, AutoModel, AutoModelForSequenceClassification,
AutoTokenizer.

`from_pretrained` follows transformers' order: resolve files -> config -> model class -> dtype -> build on the
meta device (no memory, no random init) -> stream each tensor from disk straight into its final dtype and
device -> tie weights -> rotary buffers -> attention backend -> eval() -> generation config -> Triton kernels
(use_kernels=True, kernels/mapping.py). A LoRA adapter folder (adapter_config.json) loads the base model it names,
then the adapter onto it (model.load_adapter), as transformers does. AutoModel and
AutoModelForSequenceClassification load the same way into the family's bare model or classifier (models/heads.py:
either key layout, a classifier's fresh score).

Offers: AutoConfig, AutoModelForCausalLM, AutoModel, AutoModelForSequenceClassification, AutoTokenizer,
load_pretrained.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from gpuformers.hub import CONFIG_PATTERNS, WEIGHT_PATTERNS, HubKwargs, resolve_model_dir
from gpuformers.lora.config import CONFIG_NAME as ADAPTER_CONFIG_NAME, LoraConfig
from gpuformers.models.config import ModelConfig
from gpuformers.models.heads import (BaseModelHead, TaskModel, base_model_class, causal_lm_class, checkpoint_view,
                                     sequence_classification_class)
from gpuformers.models.modeling import skip_init
from gpuformers.models.registry import model_class_for

logger = logging.getLogger(__name__)

_DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


class AutoConfig:
    @staticmethod
    def from_pretrained(name_or_path: str | os.PathLike, **hub_kwargs) -> ModelConfig:
        return ModelConfig.from_pretrained(name_or_path, **hub_kwargs)

    @staticmethod
    def for_model(model_type: str, **kwargs) -> ModelConfig:
        return ModelConfig.from_dict({"model_type": model_type, **kwargs})


class AutoModelForCausalLM:
    """`AutoModelForCausalLM.from_pretrained(id_or_folder, dtype=, device_map=, attn_implementation=, ...)`."""

    def __init__(self):
        raise TypeError("use AutoModelForCausalLM.from_pretrained(...) or .from_config(config)")

    @staticmethod
    def from_pretrained(name_or_path: str | os.PathLike, **kwargs):
        return load_pretrained(name_or_path, **kwargs)

    @staticmethod
    def from_config(config: ModelConfig, dtype: torch.dtype | str | None = None, attn_implementation: str | None = None):
        """A randomly initialised model (for training from scratch and tests)."""
        return _from_config(model_class_for(config), config, dtype, attn_implementation)


class AutoModel:
    """`AutoModel.from_pretrained(id_or_folder, ...)`: the family's bare decoder (Qwen3Model, ...), whose forward
    returns last_hidden_state; from a bare model's checkpoint or a causal LM's (its lm_head unused). The arguments
    are AutoModelForCausalLM's."""

    def __init__(self):
        raise TypeError("use AutoModel.from_pretrained(...) or .from_config(config)")

    @staticmethod
    def from_pretrained(name_or_path: str | os.PathLike, **kwargs):
        return load_pretrained(name_or_path, head=base_model_class, **kwargs)

    @staticmethod
    def from_config(config: ModelConfig, dtype: torch.dtype | str | None = None,
                    attn_implementation: str | None = None):
        return _from_config(base_model_class(causal_lm_class(config.model_type)), config, dtype, attn_implementation)


class AutoModelForSequenceClassification:
    """`AutoModelForSequenceClassification.from_pretrained(id_or_folder, num_labels=, id2label=, label2id=,
    problem_type=, pad_token_id=, ...)`: the family's decoder + score (Qwen3ForSequenceClassification, ...), from a
    classifier's checkpoint, or a causal LM's or bare model's with score initialised at random. The label settings
    override config.json's; the other arguments are AutoModelForCausalLM's."""

    def __init__(self):
        raise TypeError("use AutoModelForSequenceClassification.from_pretrained(...) or .from_config(config)")

    @staticmethod
    def from_pretrained(name_or_path: str | os.PathLike, **kwargs):
        return load_pretrained(name_or_path, head=sequence_classification_class, **kwargs)

    @staticmethod
    def from_config(config: ModelConfig, dtype: torch.dtype | str | None = None, attn_implementation: str | None = None,
                    **labels):
        """A randomly initialised classifier; `labels`: num_labels, id2label, label2id, problem_type, pad_token_id
        (config.json's otherwise)."""
        cls = sequence_classification_class(causal_lm_class(config.model_type))
        return _from_config(cls, cls.configure(config, **labels), dtype, attn_implementation)


class AutoTokenizer:
    @staticmethod
    def from_pretrained(name_or_path: str | os.PathLike, **kwargs):
        from gpuformers.tokenizer import PreTrainedTokenizerFast

        gguf_file = kwargs.pop("gguf_file", None)
        if gguf_file is not None:
            from gpuformers.loading.gguf import read_gguf

            tokenizer_object, fields = read_gguf(_gguf_path(name_or_path, gguf_file)).tokenizer_parts()
            return PreTrainedTokenizerFast(tokenizer_object, **fields, name_or_path=str(name_or_path), **kwargs)
        return PreTrainedTokenizerFast.from_pretrained(name_or_path, **kwargs)


def _from_config(cls, config: ModelConfig, dtype, attn_implementation):
    from gpuformers.device import parse_dtype

    model = cls(config)
    model.apply(_init_weights(config.initializer_range))
    model.tie_weights()
    if dtype is not None and dtype != "auto":
        model.to(parse_dtype(dtype))
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model


def _init_weights(std: float):
    def init(module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=std)

    return init


def _gguf_path(name_or_path, gguf_file) -> Path:
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


def load_pretrained(
    name_or_path: str | os.PathLike,
    *,
    model_class=None,
    head=None,
    config: ModelConfig | None = None,
    dtype="auto",
    torch_dtype=None,
    device_map=None,
    attn_implementation: str | None = None,
    gguf_file: str | os.PathLike | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    trust_remote_code: bool = False,
    output_loading_info: bool = False,
    progress: bool = True,
    low_cpu_mem_usage: bool | None = None,  # always true here; accepted for transformers compatibility
    use_kernels: bool = False,
    kernel_config=None,
    max_memory: dict | None = None,
    offload_folder: str | os.PathLike | None = None,
    quantization_config=None,
    tp_plan=None,
    tp_size: int | None = None,
    adapter_name: str = "default",
    **kwargs,
):
    """Load a checkpoint into `model_class` (or the class its config.json names), or into the head built on the
    family's causal LM class by `head` (models/heads.py: base_model_class, sequence_classification_class), whose
    settings (num_labels, ...) come in `kwargs`."""
    from gpuformers.device import parse_dtype, resolve_dtype

    task = head is not None or (model_class is not None and issubclass(model_class, TaskModel))
    if kwargs and not task:  # a head checks its own settings (TaskModel.configure)
        raise TypeError(f"from_pretrained() got unexpected arguments: {', '.join(sorted(kwargs))}")
    if trust_remote_code:
        logger.warning("trust_remote_code=True is ignored: gpuformers never runs code from a checkpoint")
    if torch_dtype is not None:  # the old name
        dtype = torch_dtype
    dtype = parse_dtype(dtype)
    tp_device = None
    if tp_plan is not None or tp_size is not None:
        # Loaded on the CPU, then each process's slices go to its device (tensor_parallel.py)
        tp_device, device_map = _tensor_parallel_device(tp_plan, device_map, gguf_file), "cpu"
    device = _resolve_device_map(device_map)
    hub = HubKwargs(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)

    if gguf_file is not None:
        if task:
            raise NotImplementedError("a GGUF file loads into a causal LM only (AutoModelForCausalLM); load a "
                                      "safetensors checkpoint for AutoModel or AutoModelForSequenceClassification")
        model = _load_gguf(_gguf_path(name_or_path, gguf_file), model_class, dtype, device, attn_implementation,
                           progress, max_memory)
        if quantization_config is not None:  # GGUF weights are dequantized on load: quantize them after
            model.quantization_config = _quantize(model, model.config, quantization_config, model.dtype, loaded=True)
        return _apply_kernels(model, use_kernels, kernel_config, attn_implementation)

    folder = resolve_model_dir(name_or_path, CONFIG_PATTERNS + WEIGHT_PATTERNS + [ADAPTER_CONFIG_NAME], hub)
    adapter_folder = None
    if (folder / ADAPTER_CONFIG_NAME).is_file():  # a LoRA adapter: load its base model, then the adapter onto it
        adapter_folder = folder
        if not (folder / "config.json").is_file():  # else the folder holds its base model too (transformers' rule)
            name_or_path = _adapter_base_model(folder)
            folder = resolve_model_dir(name_or_path, CONFIG_PATTERNS + WEIGHT_PATTERNS, hub)
    if config is None:
        config = ModelConfig.from_file(folder / "config.json")
    cls = _pick_class(model_class, config, head)
    if task:
        config = cls.configure(config, **kwargs)

    from gpuformers.loading.weights import CheckpointFiles, load_weights
    from gpuformers.quantization.config import finish_loading

    files = CheckpointFiles.find(folder)
    checkpoint_dtype = parse_dtype(config.dtype) if config.dtype else files.first_floating_dtype()
    if checkpoint_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # FP8 weights compute in bfloat16
        checkpoint_dtype = torch.bfloat16
    # (under tp_plan the weights are read on the CPU but computed on tp_device: its GPU decides, as with device_map)
    dtype = resolve_dtype(dtype, checkpoint_dtype=checkpoint_dtype, device=tp_device or device)

    with torch.device("meta"), skip_init():
        model = cls(config)
    quantization = _quantize(model, config, quantization_config, dtype)
    if task:
        model.unquantize_head()
    plan = offload = None
    if not isinstance(device, torch.device):  # several devices: plan, load each tensor where planned, then hook
        from gpuformers.loading.device_map import dispatch_model, main_device, prepare_device_map

        plan, offload = prepare_device_map(model, device, max_memory=max_memory, dtype=dtype,
                                           offload_folder=offload_folder)
        device = main_device(plan)
    target, place = model, plan
    if task:  # the checkpoint's keys may be a causal LM's, a classifier's or a bare model's (models/heads.py)
        target, rename_plan = checkpoint_view(model, files.keys())
        if plan is not None and rename_plan is not None:
            place = rename_plan(plan)
    info = load_weights(target, files, dtype=dtype, device=place or device, offload=offload, tied=model.tied_weights,
                        ignore_missing=model.allowed_missing if task else (), progress=progress)
    if task:
        _report_head_load(model, info, folder)
    quantization = finish_loading(model, quantization, info.unexpected)  # FP8: plain dequantized Linear layers
    model = _finish(model, device, attn_implementation, str(name_or_path))
    model.quantization_config = quantization
    if plan is not None:
        dispatch_model(model, plan, offload)
        model.hf_device_map = plan
    if not task:  # a head does not generate (transformers gives it no generation config either)
        model.generation_config = _generation_config(folder / "generation_config.json", config)
    if tp_device is not None:
        from gpuformers.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_plan, tp_size, device=tp_device)
        model.hf_device_map = {"": str(tp_device)}
    _apply_kernels(model, use_kernels, kernel_config, attn_implementation)
    if adapter_folder is not None:
        model.load_adapter(adapter_folder, adapter_name=adapter_name)
    return (model, info) if output_loading_info else model


def _adapter_base_model(adapter_folder: Path) -> str:
    """The base model an adapter folder names: adapter_config.json's base_model_name_or_path."""
    base = LoraConfig.from_pretrained(adapter_folder).base_model_name_or_path
    if not base:
        raise ValueError(f"{adapter_folder / ADAPTER_CONFIG_NAME} names no base model (base_model_name_or_path is "
                         f"{base!r}); load the base model with from_pretrained(base), then call "
                         f"model.load_adapter({str(adapter_folder)!r})")
    return base


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


def _quantize(model, config: ModelConfig, requested, dtype: torch.dtype, loaded: bool = False):
    """Swap the model's linear layers for quantized ones before loading, when asked by the caller or by the
    checkpoint's config.json (a pre-quantized checkpoint, whose settings then win, as in transformers)."""
    from gpuformers.quantization.config import checkpoint_quantization, quantize_linear_layers

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


def _finish(model, device, attn_implementation, name_or_path):
    model.tie_weights()
    model.reset_buffers(device)
    model.set_attn_implementation(attn_implementation or "sdpa")
    model.name_or_path = name_or_path
    model.hf_device_map = {"": str(device)}
    return model.eval()


def _apply_kernels(model, use_kernels: bool, kernel_config, attn_implementation: str | None):
    """Check the attention backend can run where the model is, then swap in Triton kernels for use_kernels=True."""
    if attn_implementation in ("flash_attention_2", "flash_attention_3"):
        from gpuformers.layers.flash_attention import check_backend_device

        check_backend_device(attn_implementation, model.device)
    if kernel_config is not None and not use_kernels:
        raise ValueError("kernel_config is only used with use_kernels=True; pass both")
    if use_kernels:
        from gpuformers.kernels.mapping import Mode, kernelize

        kernelize(model, mode=Mode.TRAINING if model.training else Mode.INFERENCE, kernel_config=kernel_config)
    return model


def _generation_config(path: Path, config: ModelConfig):
    from gpuformers.generation.config import GenerationConfig

    if path.is_file():
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(config)


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


def _load_gguf(path: Path, model_class, dtype, device, attn_implementation, progress, max_memory=None):
    from tqdm.auto import tqdm

    from gpuformers.device import resolve_dtype
    from gpuformers.loading.gguf import read_gguf
    from gpuformers.loading.weights import assign_tensor

    checkpoint = read_gguf(path)
    config = ModelConfig.from_dict(checkpoint.config)
    cls = _pick_class(model_class, config)
    # GGUF holds quantized or half weights; dequantize into float32 on the CPU unless told otherwise.
    dtype = resolve_dtype(dtype, checkpoint_dtype=torch.float32, device=device)
    with torch.device("meta"), skip_init():
        model = cls(config)
    if not isinstance(device, torch.device):  # a strategy or a per-module map: its plan must name one device
        device = _gguf_device(model, device, max_memory, dtype)
    tied = model.tied_weights
    names = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in tied]
    available = set(checkpoint.tensor_names())
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(f"GGUF file {path} lacks tensors for: {', '.join(missing[:10])}")
    for name in tqdm(names, desc="Dequantizing GGUF tensors", disable=not progress):
        assign_tensor(model, name, checkpoint.load_tensor(name, dtype=dtype, device=device))
    model = _finish(model, device, attn_implementation, str(path))
    from gpuformers.generation.config import GenerationConfig

    model.generation_config = GenerationConfig.from_dict(checkpoint.generation_config)
    return model
