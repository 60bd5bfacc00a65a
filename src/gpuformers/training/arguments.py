"""TrainingArguments: the transformers fields and defaults, the device, and the mixed-precision choice.

Beyond transformers: `bf16="auto"` / `fp16="auto"` pick bfloat16 on compute capability >= 8.0 and float16 on older
GPUs (the same rule as `dtype="auto"`, `gpuformers.device.default_dtype`), and plain float32 on the CPU.

Offers: TrainingArguments, SCHEDULERS, OPTIMIZERS, STRATEGIES.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_foreach", "sgd")
STRATEGIES = ("no", "steps", "epoch")
_AUTO = "auto"


def _strategy(name: str, value: Any) -> str:
    value = getattr(value, "value", value)  # transformers' IntervalStrategy enums
    if value not in STRATEGIES:
        raise ValueError(f'{name} "{value}" is not one of: {", ".join(STRATEGIES)}')
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
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    max_grad_norm: float = 1.0
    bf16: bool | str = False  # True, False or "auto"
    fp16: bool | str = False  # True, False or "auto"
    tf32: bool | None = None
    gradient_checkpointing: bool | None = None
    torch_compile: bool = False
    torch_compile_mode: str | None = None
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    disable_tqdm: bool | None = None
    report_to: str | list[str] = "none"
    eval_strategy: str = "no"
    eval_steps: float | None = None
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    ignore_data_skip: bool = False
    seed: int = 42
    data_seed: int | None = None
    use_cpu: bool = False
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = "random"  # "random" or "sequential"
    ddp_backend: str | None = None
    fsdp: str | list | bool | None = None
    fsdp_config: dict | None = None
    deepspeed: str | dict | None = None
    resume_from_checkpoint: str | None = None  # read by scripts; Trainer.train takes its own argument
    run_name: str | None = None

    def __post_init__(self):
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.fspath(self.output_dir)
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
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(f'lr_scheduler_type "{self.lr_scheduler_type}" is not one of: {", ".join(SCHEDULERS)}')
        if self.optim not in OPTIMIZERS:
            raise ValueError(f'optim "{self.optim}" is not one of: {", ".join(OPTIMIZERS)}')
        if self.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(f'train_sampling_strategy "{self.train_sampling_strategy}" is not one of: '
                             "random, sequential")
        self.logging_strategy = _strategy("logging_strategy", self.logging_strategy)
        self.eval_strategy = _strategy("eval_strategy", self.eval_strategy)
        self.save_strategy = _strategy("save_strategy", self.save_strategy)
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps  # transformers' fallback
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
        if self.deepspeed:
            raise NotImplementedError("deepspeed is not supported by gpuformers' Trainer; use a single GPU for now")
        if self.fsdp:
            options = (["full_shard"] if self.fsdp is True else
                       self.fsdp.split() if isinstance(self.fsdp, str) else list(self.fsdp))
            unsupported = [o for o in options if o not in ("full_shard", "auto_wrap")]
            if unsupported:
                raise NotImplementedError(f"fsdp options {unsupported} are not implemented in gpuformers' Trainer: it "
                                          "shards fully with FSDP2, one decoder layer at a time; use fsdp='full_shard'")
        self._check_precision()

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
        return int(os.environ.get("RANK", 0))

    @property
    def distributed_strategy(self) -> str | None:
        """"fsdp" (with fsdp=...) or "ddp" when torchrun started several processes; None for one process."""
        if self.world_size <= 1:
            return None
        return "fsdp" if self.fsdp else "ddp"

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
