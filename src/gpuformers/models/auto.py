"""Entry points users call: AutoConfig, AutoModelForCausalLM, AutoModel, AutoModelForSequenceClassification,
AutoTokenizer, and load_pretrained, which every `from_pretrained` runs.

load_pretrained builds one LoadOptions from the call's keywords (checked once, in __post_init__), then runs
named steps in a fixed order over one LoadState (the steps, and why this order: models/load_steps.py):

    CHECKPOINT_STEPS (a folder or Hub id)                GGUF_STEPS (gguf_file=)
     1 choose_devices     tp_plan: join; device_map       1 choose_devices
     2 resolve_files      the folder; an adapter's base   2 read_gguf         config + tensor table
     3 read_config        config.json (unless config=)    |
     4 pick_class         the class; a head's settings    3 pick_class
     5 find_weights       the weight files                |
     6 choose_dtype       dtype="auto" -> checkpoint's    4 choose_dtype      float32 unless told
     7 build_on_meta      no memory, no random init       5 build_on_meta
     8 quantize           before any weight is read       |
     9 plan_devices       device_map over devices         6 place_gguf        one device from a map
    10 load_weights       each tensor to its place        7 load_gguf_weights dequantized on load
    11 finish             tie, rotary, attention, eval    8 finish
    12 dispatch           device_map hooks                |
    13 add_generation_config                              9 add_generation_config
    |                                                    10 quantize_loaded   after the load
    14 split_tensor_parallel                              |
    15 apply_kernels      use_kernels=True               11 apply_kernels
    16 load_adapter       an adapter folder, last         |

This is transformers' order. A LoRA adapter folder (adapter_config.json) loads the base model it names, then the
adapter onto it (model.load_adapter), as transformers does. AutoModel and AutoModelForSequenceClassification load
the same way into the family's bare model or classifier (models/heads.py: either key layout, a classifier's fresh
score).

Offers: AutoConfig, AutoModelForCausalLM, AutoModel, AutoModelForSequenceClassification, AutoTokenizer,
load_pretrained, LoadOptions, CHECKPOINT_STEPS, GGUF_STEPS.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuformers import distributed
from gpuformers.models import load_steps as steps
from gpuformers.models.config import ModelConfig
from gpuformers.models.heads import TaskModel, base_model_class, causal_lm_class, sequence_classification_class
from gpuformers.models.load_steps import LoadState, gguf_path
from gpuformers.models.registry import model_class_for

logger = logging.getLogger(__name__)


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

            tokenizer_object, fields = read_gguf(gguf_path(name_or_path, gguf_file)).tokenizer_parts()
            return PreTrainedTokenizerFast(tokenizer_object, **fields, name_or_path=str(name_or_path), **kwargs)
        return PreTrainedTokenizerFast.from_pretrained(name_or_path, **kwargs)


def _from_config(cls, config: ModelConfig, dtype, attn_implementation):
    """Under a ZeRO-3 config in force (TrainingArguments made first), built partitioned as from_pretrained builds
    (load_steps.build_partitioned; transformers does the same), in `dtype` unless the config says fp16 / bf16."""
    from gpuformers.device import parse_dtype

    zero3 = distributed.zero3_init()
    if zero3 is not None:
        chosen = torch.float32 if dtype is None or dtype == "auto" else parse_dtype(dtype)
        model = steps.build_partitioned(cls, config, zero3, chosen, initialize=_init_weights(config.initializer_range))
        model.tie_weights()
    else:
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




@dataclass
class LoadOptions:
    """The keywords of one from_pretrained call (transformers' names and defaults), checked once; steps only read
    them. Keywords that are none of these are a head's settings (num_labels, ...), which its class checks."""

    model_class: type | None = None  # Qwen3ForCausalLM.from_pretrained: the class asked for
    head: Any = None  # AutoModel / AutoModelForSequenceClassification: builds the head class on the family's class
    config: ModelConfig | None = None  # used instead of config.json
    dtype: Any = "auto"  # as users write it; __post_init__ makes it a torch.dtype or "auto"
    torch_dtype: Any = None  # the old name of dtype; wins when given
    device_map: Any = None
    attn_implementation: str | None = None
    gguf_file: str | os.PathLike | None = None
    revision: str | None = None
    cache_dir: str | os.PathLike | None = None
    local_files_only: bool = False
    token: str | bool | None = None
    trust_remote_code: bool = False
    output_loading_info: bool = False
    progress: bool = True
    low_cpu_mem_usage: bool | None = None  # always true here; accepted for transformers compatibility
    use_kernels: bool = False
    kernel_config: Any = None
    allow_all_kernels: bool = False  # attn_implementation="org/repo" outside kernels-community (runs its code)
    max_memory: dict | None = None
    offload_folder: str | os.PathLike | None = None
    quantization_config: Any = None
    tp_plan: Any = None
    tp_size: int | None = None
    adapter_name: str = "default"
    head_settings: dict = field(default_factory=dict)

    @classmethod
    def from_keywords(cls, keywords: dict) -> LoadOptions:
        names = {f.name for f in dataclasses.fields(cls)} - {"head_settings"}
        known = {k: v for k, v in keywords.items() if k in names}
        return cls(**known, head_settings={k: v for k, v in keywords.items() if k not in names})

    def __post_init__(self):
        from gpuformers.device import parse_dtype

        if self.head_settings and not self.task:  # a head checks its own settings (TaskModel.configure)
            raise TypeError(f"from_pretrained() got unexpected arguments: {', '.join(sorted(self.head_settings))}")
        if self.trust_remote_code:
            logger.warning("trust_remote_code=True is ignored: gpuformers never runs code from a checkpoint")
        self.dtype = parse_dtype(self.dtype if self.torch_dtype is None else self.torch_dtype)
        if self.gguf_file is not None and self.task:
            raise NotImplementedError("a GGUF file loads into a causal LM only (AutoModelForCausalLM); load a "
                                      "safetensors checkpoint for AutoModel or AutoModelForSequenceClassification")
        if self.kernel_config is not None and not self.use_kernels:  # (said before the load, not after it)
            raise ValueError("kernel_config is only used with use_kernels=True; pass both")

    @property
    def task(self) -> bool:
        """A head (bare model or classifier) rather than a causal LM: its own settings, key layouts and no
        generation config."""
        return self.head is not None or (self.model_class is not None and issubclass(self.model_class, TaskModel))


CHECKPOINT_STEPS = (
    steps.choose_devices, steps.resolve_files, steps.read_config, steps.pick_class, steps.find_weights,
    steps.choose_dtype, steps.build_on_meta, steps.quantize, steps.plan_devices, steps.load_weights, steps.finish,
    steps.dispatch, steps.add_generation_config, steps.split_tensor_parallel, steps.apply_kernels, steps.load_adapter,
)
GGUF_STEPS = (
    steps.choose_devices, steps.read_gguf, steps.pick_class, steps.choose_dtype, steps.build_on_meta,
    steps.place_gguf, steps.load_gguf_weights, steps.finish, steps.add_generation_config, steps.quantize_loaded,
    steps.apply_kernels,
)


def load_pretrained(name_or_path: str | os.PathLike, **keywords):
    """Load a checkpoint into `model_class` (or the class its config.json names), or into the head built on the
    family's causal LM class by `head` (models/heads.py: base_model_class, sequence_classification_class), whose
    settings (num_labels, ...) come in the other keywords. The keywords are LoadOptions' fields."""
    options = LoadOptions.from_keywords(keywords)
    state = LoadState(name_or_path, config=options.config)
    for step in GGUF_STEPS if options.gguf_file is not None else CHECKPOINT_STEPS:
        step(options, state)
    return state.result(options.output_loading_info)
