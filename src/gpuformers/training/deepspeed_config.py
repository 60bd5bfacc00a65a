"""DeepSpeed configs for the Trainer: a user's DeepSpeed JSON (a path or a dict, in transformers' style) with its
"auto" values filled from the TrainingArguments, and each value that the arguments also set checked against them.

    TrainingArguments(deepspeed="ds_config.json")     read and filled when the arguments are made (fill_from_arguments;
                                                       a config with fewer than two of the batch keys gets the micro
                                                       batch and the accumulation from the arguments):
        train_micro_batch_size_per_gpu   <- per_device_train_batch_size
        gradient_accumulation_steps      <- gradient_accumulation_steps
        train_batch_size                 <- world_size x per_device_train_batch_size x gradient_accumulation_steps
        gradient_clipping                <- max_grad_norm
        optimizer.params lr, betas, eps, weight_decay   <- learning_rate, adam_beta1/2, adam_epsilon, weight_decay
        scheduler.params warmup_max_lr   <- learning_rate (warmup_min_lr: 0)
        fp16.enabled / bf16.enabled      <- fp16 / bf16 (a section is added when the arguments ask and the config
                                            is silent)
    Trainer.train()                                    once the model and the run's length are known (finalize):
        zero_optimization reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold
                                         <- hidden_size^2, 0.9 hidden_size^2, 10 hidden_size
        scheduler.params total_num_steps, warmup_num_steps  <- the run's steps, its warmup steps (at least 1)

A value that is not "auto" and differs from the argument's is a mismatch: those of each stage are raised together, each
naming the config key, its value, the argument and its value (transformers' rule, so a config that works there works
here; the first stage's are raised when the arguments are made, not at train()).

Offers: DeepSpeedConfig, require_deepspeed, DEEPSPEED_EXTRA.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

DEEPSPEED_EXTRA = "pip install 'gpuformers[deepspeed]'"
_AUTO = "auto"


def require_deepspeed():
    """The deepspeed module, or an ImportError that names the extra to install."""
    try:
        import deepspeed  # optional: only runs under TrainingArguments(deepspeed=...) need it
    except ImportError as error:
        raise ImportError(f"TrainingArguments(deepspeed=...) needs the deepspeed package, which is not installed "
                          f"({error}); install it with {DEEPSPEED_EXTRA} (or pip install deepspeed)") from None
    return deepspeed


class DeepSpeedConfig:
    """A DeepSpeed config dict (a deep copy of the one given, or a JSON file read), its "auto" values filled and its
    mismatches with the TrainingArguments collected (see the module docstring)."""

    def __init__(self, config: str | os.PathLike | dict):
        if isinstance(config, (str, os.PathLike)):
            try:
                with open(config, encoding="utf-8") as f:
                    config = json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError(f"deepspeed={os.fspath(config)!r}: no such DeepSpeed config file; pass the "
                                        "path of a DeepSpeed JSON config or a dict") from None
            except json.JSONDecodeError as error:
                raise ValueError(f"deepspeed={os.fspath(config)!r} is not JSON ({error}); pass a DeepSpeed JSON "
                                 "config or a dict") from None
        if not isinstance(config, dict):
            raise ValueError(f"deepspeed must be the path of a DeepSpeed JSON config or a dict, not "
                             f"{type(config).__name__}")
        self.config = copy.deepcopy(config)
        self.mismatches: list[str] = []
        stage = self.zero_stage
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeed config zero_optimization.stage={stage!r} is not one of 0, 1, 2, 3")

    # --- reading --------------------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """The value at a dotted key ("zero_optimization.stage"), or `default` where a level is missing."""
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def zero_stage(self) -> int:
        return int(self.get("zero_optimization.stage", 0))

    @property
    def is_zero3(self) -> bool:
        return self.zero_stage == 3

    @property
    def offloads(self) -> bool:
        """Optimizer states or parameters offloaded (to the CPU or NVMe)."""
        return any(str(self.get(f"zero_optimization.{part}.device", "none")).lower() not in ("none", "")
                   for part in ("offload_optimizer", "offload_param"))

    @property
    def has_optimizer(self) -> bool:
        return "optimizer" in self.config

    @property
    def has_scheduler(self) -> bool:
        return "scheduler" in self.config

    @property
    def gathers_weights_on_save(self) -> bool:
        """Under ZeRO-3: whether save_model gathers the whole weights (stage3_gather_16bit_weights_on_model_save;
        DeepSpeed's default is no)."""
        return bool(self.get("zero_optimization.stage3_gather_16bit_weights_on_model_save", False))

    # --- filling --------------------------------------------------------------------------------------------

    def fill(self, key: str, value: Any, argument: str | None = None) -> None:
        """Put `value` where the config says "auto"; otherwise, when `argument` names the TrainingArguments field it
        comes from, record a mismatch if the config's value differs. A key whose section is absent is left so."""
        *parents, leaf = key.split(".")
        node = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return
        if not isinstance(node, dict):
            return
        current = node.get(leaf)
        if current == _AUTO:
            node[leaf] = value
        elif argument is not None and current is not None and current != value:
            self.mismatches.append(f"DeepSpeed config {key}={current!r} but TrainingArguments {argument}={value!r}")

    def fill_from_arguments(self, args) -> None:
        """What the TrainingArguments decide (see the module docstring); mismatches are kept for finalize()."""
        import torch

        world = args.world_size
        batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        if sum(key in self.config for key in batch_keys) < 2:  # DeepSpeed needs two of them (it derives the third)
            self.config.setdefault("train_micro_batch_size_per_gpu", args.per_device_train_batch_size)
            self.config.setdefault("gradient_accumulation_steps", args.gradient_accumulation_steps)
        self.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size")
        self.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
        self.fill("train_batch_size", world * args.per_device_train_batch_size * args.gradient_accumulation_steps,
                  f"world_size x per_device_train_batch_size x gradient_accumulation_steps ({world} x "
                  f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps})")
        self.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
        self.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
        self.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
        self.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        self.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
        self.fill("scheduler.params.warmup_min_lr", 0)
        self.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            asked = args.mixed_precision == dtype
            if name not in self.config and asked:  # the arguments ask for it and the config is silent
                self.config[name] = {"enabled": True}
            self.fill(f"{name}.enabled", asked, name)
        if self.get("fp16.enabled") is True and self.get("bf16.enabled") is True:
            raise ValueError("the DeepSpeed config enables both fp16 and bf16; enable one of them")
        self._raise_mismatches()

    def finalize(self, model, num_training_steps: int, warmup_steps: int) -> None:
        """The values that need the model and the run's length; then every mismatch is raised at once."""
        sized = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                 "zero_optimization.stage3_param_persistence_threshold")
        if any(self.get(key) == _AUTO for key in sized):
            config = getattr(model, "config", None)
            hidden = getattr(config, "hidden_size", None) or getattr(getattr(config, "text_config", None),
                                                                     "hidden_size", None)
            if hidden is None:
                raise ValueError(f"the DeepSpeed config sets {[k for k in sized if self.get(k) == _AUTO]} to 'auto', "
                                 "which is sized from the model's hidden_size, but the model's config has none; "
                                 "give them numbers")
            self.fill(sized[0], hidden * hidden)
            self.fill(sized[1], int(0.9 * hidden * hidden))
            self.fill(sized[2], 10 * hidden)
        self.fill("scheduler.params.total_num_steps", num_training_steps, "max_steps (the run's optimizer steps)")
        # DeepSpeed refuses warmup_num_steps <= 0
        self.fill("scheduler.params.warmup_num_steps", max(1, warmup_steps), "warmup_steps")
        self._raise_mismatches()

    def _raise_mismatches(self) -> None:
        if self.mismatches:
            raise ValueError("the DeepSpeed config contradicts the TrainingArguments:\n  " + "\n  ".join(
                self.mismatches) + "\nset these DeepSpeed values to \"auto\" (filled from the arguments), or change "
                "the arguments to match")
