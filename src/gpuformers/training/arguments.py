"""TrainingArguments: the transformers fields and defaults, the device, and the mixed-precision choice.

Beyond transformers: `bf16="auto"` / `fp16="auto"` pick bfloat16 on compute capability >= 8.0 and float16 on older
GPUs (the same rule as `dtype="auto"`, `gpuformers.device.default_dtype`), and plain float32 on the CPU.

FSDP: `fsdp` and `fsdp_config` become a `distributed.FSDPOptions` in fsdp_config.py. DeepSpeed: `deepspeed` (a JSON
config's path or a dict) becomes a `DeepSpeedConfig` with its "auto" values filled (deepspeed_config.py). Under
`accelerate launch`, its environment sets deepspeed, fsdp, bf16 / fp16 and use_cpu where they are left open
(accelerate_env.py).

Offers: TrainingArguments, SCHEDULERS, OPTIMIZERS, REFUSED, STRATEGIES.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gpuformers.training.accelerate_env import launcher_overrides
from gpuformers.training.fsdp_config import fsdp_options, load_fsdp_config

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
              "reduce_lr_on_plateau")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_foreach", "adafactor", "sgd", "adagrad", "rmsprop",
              "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "lion_32bit", "lion_8bit",
              "paged_lion_32bit", "paged_lion_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
              "ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit")
_ELSEWHERE = "needs a package gpuformers does not use"
# transformers' lr_scheduler_type and optim names that gpuformers refuses, and why
REFUSED = {
    "greedy": "transformers' GreedyLR (raising and lowering the rate on the evaluation metric) is not implemented; "
              "reduce_lr_on_plateau lowers it on the metric",
    "adamw_torch_xla": "it is for TPUs (torch_xla)", "adamw_torch_npu_fused": "it is for Ascend NPUs (torch_npu)",
    "adamw_torch_4bit": f"it {_ELSEWHERE} (torchao); adamw_8bit is bitsandbytes' 8-bit AdamW",
    "adamw_torch_8bit": f"it {_ELSEWHERE} (torchao); adamw_8bit is bitsandbytes' 8-bit AdamW",
    "adamw_anyprecision": f"it {_ELSEWHERE} (torchdistx)", "grokadamw": f"it {_ELSEWHERE} (grokadamw)",
    "stable_adamw": f"it {_ELSEWHERE} (torch-optimi)", "lomo": f"it {_ELSEWHERE} (lomo-optim)",
    "adalomo": f"it {_ELSEWHERE} (lomo-optim)",
    **dict.fromkeys(("galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
                     "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise"), f"it {_ELSEWHERE} (galore-torch)"),
    **dict.fromkeys(("apollo_adamw", "apollo_adamw_layerwise"), f"it {_ELSEWHERE} (apollo-torch)"),
    **dict.fromkeys(("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd"),
                    f"it {_ELSEWHERE} (schedulefree)"),
}
STRATEGIES = ("no", "steps", "epoch")
_AUTO = "auto"


def _strategy(name: str, value: Any, choices: tuple[str, ...] = STRATEGIES) -> str:
    value = getattr(value, "value", value)  # transformers' IntervalStrategy enums
    if value not in choices:
        raise ValueError(f'{name} "{value}" is not one of: {", ".join(choices)}')
    return value


@dataclass
class TrainingArguments:
    """What the Trainer does, with transformers' names and defaults (see docs/training.md for what is not here)."""

    output_dir: str | None = None  # None -> "trainer_output", as transformers
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | None = None
    warmup_steps: float = 0  # an int of steps, or a float < 1: a ratio of the training steps
    warmup_ratio: float | None = None  # transformers 4.x name; folded into warmup_steps
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None  # "key=value,..." for sgd, adagrad, rmsprop, ademamix (see optim.py)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    max_grad_norm: float = 1.0
    label_smoothing_factor: float = 0.0
    bf16: bool | str = False  # True, False or "auto"
    fp16: bool | str = False  # True, False or "auto"
    tf32: bool | None = None
    # transformers 5 names them activation_checkpointing(_kwargs), the gradient_ names being its older aliases
    gradient_checkpointing: bool | None = None
    gradient_checkpointing_kwargs: dict | str | None = None  # e.g. {"use_reentrant": False} (see _checkpoint_kwargs)
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict | str | None = None
    neftune_noise_alpha: float | None = None
    torch_compile: bool = False
    torch_compile_mode: str | None = None
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    disable_tqdm: bool | None = None
    report_to: str | list[str] = "none"
    logging_dir: str | None = None  # transformers 4.x name: TensorBoard's folder (default output_dir/runs)
    include_num_input_tokens_seen: str | bool = "no"  # "all" (True), "non_padding" or "no" (False)
    eval_strategy: str = "no"
    eval_steps: float | None = None
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None  # an evaluate() key, "eval_" optional; "loss" with load_best_model_at_end
    greater_is_better: bool | None = None  # default: False for a metric ending in "loss", True otherwise
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False  # a resume restores stateful callbacks (early stopping)
    seed: int = 42
    data_seed: int | None = None
    use_cpu: bool = False
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = "random"  # "random", "sequential" or "group_by_length"
    group_by_length: bool = False  # transformers 4's switch: train_sampling_strategy="group_by_length"
    length_column_name: str = "length"  # a datasets.Dataset column of row lengths, read by group_by_length
    ddp_backend: str | None = None  # "nccl", "gloo" or "mpi"; None: nccl on GPUs, gloo on the CPU
    ddp_timeout: int = 1800  # seconds a collective may wait (init_process_group's timeout)
    # DistributedDataParallel's arguments (distributed.DDPOptions); None: transformers' defaults (model_setup.py)
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    fsdp: str | list | bool | None = None
    fsdp_config: dict | None = None
    deepspeed: str | dict | None = None
    resume_from_checkpoint: str | None = None  # read by scripts; Trainer.train takes its own argument
    run_name: str | None = None

    # accelerate launch's ACCELERATE_DEEPSPEED_ZERO3_INIT=false sets it false (accelerate_env.py); not a field
    _deepspeed_zero3_init = True

    def __post_init__(self):
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.fspath(self.output_dir)
        for name, value in launcher_overrides(self).items():  # accelerate launch's plugins, as transformers reads them
            setattr(self, name, value)
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate {self.learning_rate} is negative; pass a rate >= 0 such as 5e-5")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r} must be a whole number >= 1")
        if self.max_steps == 0 or (self.max_steps < 0 and self.num_train_epochs <= 0):
            raise ValueError(f"nothing to train: max_steps={self.max_steps}, num_train_epochs={self.num_train_epochs};"
                             " set max_steps > 0 or num_train_epochs > 0")
        if self.warmup_ratio is not None:
            if not 0 <= self.warmup_ratio < 1:
                raise ValueError(f"warmup_ratio {self.warmup_ratio} must be in [0, 1)")
            self.warmup_steps = self.warmup_ratio
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps {self.warmup_steps} is negative; pass a step count or a ratio in [0, 1)")
        if isinstance(self.lr_scheduler_kwargs, str):  # JSON from a command line, as transformers reads it
            self.lr_scheduler_kwargs = _json_dict("lr_scheduler_kwargs", self.lr_scheduler_kwargs)
        for name, choices in (("lr_scheduler_type", SCHEDULERS), ("optim", OPTIMIZERS)):
            value = getattr(self, name)
            if value in REFUSED:
                raise ValueError(f'{name} "{value}" is not supported by gpuformers: {REFUSED[value]}')
            if value not in choices:
                raise ValueError(f'{name} "{value}" is not one of: {", ".join(choices)}')
        if self.group_by_length and self.train_sampling_strategy not in ("random", "group_by_length"):
            raise ValueError("group_by_length=True contradicts train_sampling_strategy="
                             f'"{self.train_sampling_strategy}"; drop one of them')
        if self.group_by_length:
            self.train_sampling_strategy = "group_by_length"
        if self.train_sampling_strategy not in ("random", "sequential", "group_by_length"):
            raise ValueError(f'train_sampling_strategy "{self.train_sampling_strategy}" is not one of: '
                             "random, sequential, group_by_length")
        self.logging_strategy = _strategy("logging_strategy", self.logging_strategy)
        self.eval_strategy = _strategy("eval_strategy", self.eval_strategy)
        # "best": a checkpoint after each evaluation that beats the best metric so far
        self.save_strategy = _strategy("save_strategy", self.save_strategy, STRATEGIES + ("best",))
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps  # transformers' fallback
        if self.eval_strategy == "steps" and not self.eval_steps:
            raise ValueError(f'eval_strategy "steps" needs eval_steps > 0 (or logging_steps > 0, its default), not '
                             f"{self.eval_steps}")
        self._check_best_model()
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"save_total_limit {self.save_total_limit} must be >= 1 "
                             "(or None to keep every checkpoint)")
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        unknown = [r for r in self.report_to if r not in ("tensorboard", "jsonl")]
        if unknown:
            raise ValueError(f"report_to {unknown} is not supported; use 'none' or 'tensorboard' "
                             "(the JSONL log in output_dir is always written)")
        for name in ("bf16", "fp16"):
            value = getattr(self, name)
            if value not in (True, False, _AUTO):
                raise ValueError(f'{name}={value!r} is not one of: True, False, "auto"')
        if self.bf16 is True and self.fp16 is True:
            raise ValueError("bf16=True and fp16=True were both set; pick one (or bf16='auto' to let the GPU decide)")
        self._check_training_extras()
        self._fsdp_options = self._parse_fsdp()
        self._check_precision()
        self._check_ddp()
        self._deepspeed_config = self._parse_deepspeed()

    def _check_best_model(self) -> None:
        """metric_for_best_model and greater_is_better defaults, and transformers' checks for load_best_model_at_end:
        a checkpoint must be written at every step whose evaluation may be the best."""
        on_metric = self.lr_scheduler_type == "reduce_lr_on_plateau"
        if on_metric and self.eval_strategy == "no":
            raise ValueError('lr_scheduler_type "reduce_lr_on_plateau" lowers the rate when the evaluation metric '
                             'stops improving, so it needs an eval_strategy ("steps" or "epoch") and an eval_dataset')
        if (self.load_best_model_at_end or on_metric) and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if not self.load_best_model_at_end or self.save_strategy == "best":
            return
        if self.eval_strategy != self.save_strategy:
            raise ValueError(f'load_best_model_at_end needs save_strategy equal to eval_strategy (a checkpoint at each '
                             f'evaluation) or "best", but eval_strategy is "{self.eval_strategy}" and save_strategy '
                             f'is "{self.save_strategy}"; set both to "steps" or both to "epoch"')
        if self.eval_strategy != "steps":
            return
        save, evaluate = self.save_steps, self.eval_steps
        if not save % evaluate:
            return
        if (save < 1) != (evaluate < 1):
            raise ValueError(f"load_best_model_at_end needs save_steps to be a multiple of eval_steps, which a ratio "
                             f"and a step count cannot guarantee (save_steps={save}, eval_steps={evaluate}); give "
                             "both as step counts or both as ratios of the training steps")
        # ratios compared in millionths, as transformers does, so that 0.3 is a multiple of 0.1
        if save >= 1 or round(save * 1_000_000) % round(evaluate * 1_000_000):
            raise ValueError(f"load_best_model_at_end needs save_steps to be a multiple of eval_steps (a checkpoint "
                             f"at each evaluation that may be the best), but save_steps={save} is not a multiple of "
                             f"eval_steps={evaluate}; set save_steps={evaluate} or a multiple of it")

    def _check_training_extras(self) -> None:
        """label_smoothing_factor, neftune_noise_alpha, (gradient|activation)_checkpointing(_kwargs),
        include_num_input_tokens_seen."""
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            # transformers' rule: the new name wins when set, and the old one then mirrors it
            if getattr(self, new) is None:
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if not 0 <= self.label_smoothing_factor <= 1:
            raise ValueError(f"label_smoothing_factor {self.label_smoothing_factor} must be in [0, 1] (0: no "
                             "smoothing; typical: 0.1)")
        if self.neftune_noise_alpha is not None and self.neftune_noise_alpha < 0:
            raise ValueError(f"neftune_noise_alpha {self.neftune_noise_alpha} is negative; pass a noise scale >= 0 "
                             "(the NEFTune paper uses 5 to 15) or None for no noise")
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        if self.include_num_input_tokens_seen not in ("all", "non_padding", "no"):
            raise ValueError(f"include_num_input_tokens_seen {self.include_num_input_tokens_seen!r} is not one of: "
                             "'all' (or True), 'non_padding', 'no' (or False)")
        if self.gradient_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs = _checkpoint_kwargs(
                self.gradient_checkpointing_kwargs)

    # --- where and how precisely to train -------------------------------------------------------------------

    @cached_property
    def device(self):
        """cuda:LOCAL_RANK (cuda:0 alone) when a GPU is visible, else cpu; always cpu with use_cpu=True."""
        import torch

        from gpuformers.distributed import process_device

        return torch.device("cpu") if self.use_cpu else process_device()

    @property
    def n_gpu(self) -> int:
        return 1 if self.device.type == "cuda" else 0

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def process_index(self) -> int:
        """This process's index among all (torchrun's RANK; 0 alone)."""
        return int(os.environ.get("RANK", 0))

    @property
    def local_process_index(self) -> int:
        """This process's index on its machine (torchrun's LOCAL_RANK; 0 alone)."""
        return max(0, self.local_rank)

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work"):
        """Within: the main process (of this machine with local=True, else of all) runs the block first and the
        others wait for it, then run it (reading what it cached): transformers' way to preprocess a dataset once.
        A barrier over all processes, so every process must enter it."""
        from gpuformers import distributed

        main = (self.local_process_index if local else self.process_index) == 0
        if not main:  # wait until the main process has done `desc`
            distributed.barrier()
        try:
            yield
        finally:
            if main:  # done: release the others
                distributed.barrier()

    @property
    def distributed_strategy(self) -> str | None:
        """"deepspeed" (with deepspeed=..., in any number of processes), else "fsdp" (with fsdp=...) or "ddp" when
        torchrun started several processes; None for one process."""
        if self._deepspeed_config is not None:
            return "deepspeed"
        if self.world_size <= 1:
            return None
        return "fsdp" if self.fsdp else "ddp"

    @property
    def deepspeed_config(self):
        """The DeepSpeed config (a deepspeed_config.DeepSpeedConfig, "auto" values filled from these arguments) with
        deepspeed=... or under accelerate launch --use_deepspeed; None otherwise."""
        return self._deepspeed_config

    @property
    def fsdp_options(self):
        """How FSDP2 shards the model (a distributed.FSDPOptions), parsed from fsdp and fsdp_config; None without
        fsdp."""
        return self._fsdp_options

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", -1))

    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @cached_property
    def mixed_precision(self):
        """The autocast dtype (torch.bfloat16 / torch.float16) or None for full precision; "auto" resolved here."""
        import torch

        from gpuformers.device import default_dtype

        if self.bf16 is True:
            return torch.bfloat16
        if self.fp16 is True:
            return torch.float16
        if _AUTO in (self.bf16, self.fp16):
            # either flag at "auto": the GPU's best half precision, the rule dtype="auto" uses (float32 on the CPU)
            chosen = default_dtype(self.device)
            return None if chosen == torch.float32 else chosen
        return None

    def _parse_fsdp(self):
        """fsdp and fsdp_config -> FSDPOptions (fsdp_config.py), every value checked; None without fsdp."""
        if not self.fsdp:
            if self.fsdp_config:
                raise ValueError(f"fsdp_config {self.fsdp_config!r} was given but fsdp is off; pass fsdp=True (or "
                                 "fsdp='full_shard', 'shard_grad_op', ...) to shard with FSDP2, or drop fsdp_config")
            return None
        self.fsdp_config = load_fsdp_config(self.fsdp_config)  # a JSON file's path is read, and kept read
        options, checkpointing = fsdp_options(self.fsdp, self.fsdp_config)
        if checkpointing:  # fsdp_config activation_checkpointing: transformers' FSDP name for it
            self.gradient_checkpointing = self.activation_checkpointing = True
        return options

    def _parse_deepspeed(self):
        """deepspeed=... -> a DeepSpeedConfig filled from these arguments (deepspeed_config.py), once the package is
        known to be there; None without deepspeed."""
        if not self.deepspeed:
            return None
        from gpuformers.training.deepspeed_config import DeepSpeedConfig, require_deepspeed

        if self.fsdp:
            raise ValueError(f"deepspeed and fsdp={self.fsdp!r} were both given; shard with one of them")
        if self.lr_scheduler_type == "reduce_lr_on_plateau":
            raise NotImplementedError('lr_scheduler_type "reduce_lr_on_plateau" under DeepSpeed is not supported '
                                      "(DeepSpeed steps the scheduler after every optimizer step, without the "
                                      "metric); pick another lr_scheduler_type")
        if self.torch_compile:
            raise NotImplementedError("torch_compile=True under DeepSpeed is not supported yet (the engine's hooks "
                                      "around each module are not compiled here); drop torch_compile or deepspeed")
        if self.device.type == "cpu":  # DeepSpeed picks its accelerator once, at its first use: the CPU's here
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        require_deepspeed()
        config = DeepSpeedConfig(self.deepspeed)
        config.fill_from_arguments(self)
        self._register_zero3_init(config)
        return config

    def _register_zero3_init(self, config) -> None:
        """Under ZeRO-3, a from_pretrained called while these arguments live builds the model partitioned
        (deepspeed.zero.Init inside the process group the Trainer will use), as transformers does;
        ACCELERATE_DEEPSPEED_ZERO3_INIT=false (accelerate launch's zero3_init_flag) leaves it whole. Arguments with
        another DeepSpeed config end what earlier ones registered (the last one made wins, as in transformers)."""
        from gpuformers import distributed
        from gpuformers.training.deepspeed_engine import init_process_group

        self._zero3_init = None  # kept here: the registration is a weak reference to it
        if config.is_zero3 and self._deepspeed_zero3_init:
            join = functools.partial(init_process_group, self.device, self.ddp_timeout, self.ddp_backend)
            self._zero3_init = distributed.ZeroInit(config.config, self.device, join)
        distributed.set_zero3_init(self._zero3_init)

    def _check_precision(self) -> None:
        import torch

        device = self.device
        if device.type == "cpu":
            if self.fp16 is True:
                raise ValueError("fp16=True needs a CUDA GPU (no GPU is visible, or use_cpu=True); on the CPU train "
                                 "in float32 (the default) or bf16=True")
            return
        major, minor = torch.cuda.get_device_capability(device)
        if self.bf16 is True and (major, minor) < (8, 0):
            raise ValueError(f"bf16=True but {device} ({torch.cuda.get_device_name(device)}, compute capability "
                             f"{major}.{minor}) has no bfloat16; use fp16=True, or bf16='auto' to pick what the "
                             "GPU has")

    def _check_ddp(self) -> None:
        from gpuformers.distributed import check_backend

        check_backend(self.ddp_backend, self.device)
        if not self.ddp_timeout or self.ddp_timeout <= 0:
            raise ValueError(f"ddp_timeout {self.ddp_timeout!r} must be a number of seconds > 0 (default 1800)")
        if self.ddp_bucket_cap_mb is not None and self.ddp_bucket_cap_mb <= 0:
            raise ValueError(f"ddp_bucket_cap_mb {self.ddp_bucket_cap_mb} must be > 0 (MiB per gradient bucket; "
                             "None: DDP's 25)")

    def get_warmup_steps(self, num_training_steps: int) -> int:
        import math

        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)

    # --- saving ---------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


def _json_dict(name: str, text: str) -> dict:
    """A dict argument given as JSON text; string values that spell a bool or a number become one, as transformers'
    TrainingArguments converts them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} {text!r} is not JSON ({error}); pass a dict or a JSON object such as "
                         '\'{"patience": 2}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} {text!r} is not a JSON object; pass a dict or a JSON object such as "
                         '\'{"patience": 2}\'')
    return {key: _from_text(item) for key, item in value.items()}


def _from_text(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _from_text(item) for key, item in value.items()}
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.isdigit():
        return int(value)
    return float(value) if value.replace(".", "", 1).isdigit() else value


# transformers' own keys (every n-th decoder layer, inputs kept in host memory), then torch.utils.checkpoint's
_CHECKPOINT_KWARGS = ("every_n_layers", "offload", "use_reentrant", "preserve_rng_state", "context_fn",
                      "determinism_check", "debug", "early_stop")


def _checkpoint_kwargs(kwargs: dict | str) -> dict:
    """gradient_checkpointing_kwargs (a dict, or its JSON from a command line) with its keys checked."""
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if unknown := [k for k in kwargs if k not in _CHECKPOINT_KWARGS]:
        raise ValueError(f"gradient_checkpointing_kwargs {unknown} are not among: {', '.join(_CHECKPOINT_KWARGS)} "
                         "(every_n_layers and offload, then torch.utils.checkpoint's arguments)")
    return dict(kwargs)
