"""`accelerate launch` as a launcher: the environment it gives each process, read into the TrainingArguments the way
transformers' Trainer (through accelerate's plugins) reads it.

    accelerate launch --num_processes 2 train.py                 torchrun's variables only: DDP, as under torchrun
    accelerate launch --use_deepspeed --zero_stage 2 ...         ACCELERATE_USE_DEEPSPEED=true, ACCELERATE_DEEPSPEED_*
    accelerate launch --use_fsdp --fsdp_version 2 ...            ACCELERATE_USE_FSDP=true, FSDP_*
    accelerate launch --mixed_precision bf16 ...                 ACCELERATE_MIXED_PRECISION=bf16
    (an accelerate config file sets the same variables; its deepspeed_config_file -> ACCELERATE_DEEPSPEED_CONFIG_FILE)

What the arguments already say wins, as in transformers: deepspeed=... over ACCELERATE_USE_DEEPSPEED, fsdp=... over
ACCELERATE_USE_FSDP, bf16 / fp16 over ACCELERATE_MIXED_PRECISION.

DeepSpeed: ACCELERATE_DEEPSPEED_CONFIG_FILE is the config (the other variables fill its "auto" values only, as
accelerate does); without one, a config is made as accelerate makes it: batch sizes "auto", ZeRO stage
(ACCELERATE_DEEPSPEED_ZERO_STAGE, default 2), offload devices (..._OFFLOAD_OPTIMIZER_DEVICE, ..._OFFLOAD_PARAM_DEVICE,
their NVMe paths), stage3_gather_16bit_weights_on_model_save (..._ZERO3_SAVE_16BIT_MODEL), and
ACCELERATE_GRADIENT_ACCUMULATION_STEPS / ACCELERATE_GRADIENT_CLIPPING ("auto" when unset). Either is then filled from
the arguments like any deepspeed=... config (deepspeed_config.py). Under ZeRO-3, ACCELERATE_DEEPSPEED_ZERO3_INIT
(accelerate's zero3_init_flag; true unless set) lets a from_pretrained called after the TrainingArguments are made
build the model partitioned (deepspeed.zero.Init: models/load_steps.py); false loads it whole in every process.

FSDP: gpuformers shards with FSDP2 whatever FSDP_VERSION says (FSDP1's sharding strategies have the same meaning
there): FSDP_SHARDING_STRATEGY or FSDP_RESHARD_AFTER_FORWARD -> full_shard / shard_grad_op / hybrid_shard(_zero2),
FSDP_OFFLOAD_PARAMS -> offload, FSDP_AUTO_WRAP_POLICY (accelerate's default: NO_WRAP) and
FSDP_TRANSFORMER_CLS_TO_WRAP / FSDP_MIN_NUM_PARAMS, FSDP_ACTIVATION_CHECKPOINTING -> fsdp_config. FSDP1's
prefetch, use_orig_params and sync_module_states, the state-dict type (checkpoints are whole here) and
cpu_ram_efficient_loading (loading is gpuformers' own) have no effect.

Offers: launcher_overrides.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

logger = logging.getLogger(__name__)

_TRUE, _FALSE = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off", "")
# accelerate's FSDP1 sharding strategies, by name and by number (1-5), -> the fsdp option that means the same
_SHARDING = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
             "HYBRID_SHARD": "hybrid_shard", "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2"}


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    value = env.get(name)
    if value is None:
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a yes/no value; set it to true or false")


def launcher_overrides(args, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """TrainingArguments fields that `accelerate launch`'s environment sets, for the fields `args` leaves open."""
    env = os.environ if env is None else env
    overrides: dict[str, Any] = {}
    if not args.use_cpu and _flag(env, "ACCELERATE_USE_CPU"):
        overrides["use_cpu"] = True
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if args.bf16 is False and args.fp16 is False and precision != "no":
        if precision not in ("bf16", "fp16"):
            raise NotImplementedError(f"ACCELERATE_MIXED_PRECISION={precision!r} (accelerate launch --mixed_precision)"
                                      " is not supported; use bf16, fp16 or no")
        overrides[precision] = True
    if not args.deepspeed and _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        overrides["deepspeed"] = config = deepspeed_config_from_env(env)
        if not _flag(env, "ACCELERATE_DEEPSPEED_ZERO3_INIT", default=True):  # ZeRO-3 models load whole
            overrides["_deepspeed_zero3_init"] = False
        elif "ACCELERATE_DEEPSPEED_ZERO3_INIT" in env and config["zero_optimization"].get("stage") != 3:
            logger.warning("ACCELERATE_DEEPSPEED_ZERO3_INIT applies to ZeRO stage 3 only; with stage %s the model "
                           "loads whole", config["zero_optimization"].get("stage"))
    if not args.fsdp and _flag(env, "ACCELERATE_USE_FSDP"):
        if args.deepspeed or "deepspeed" in overrides:
            raise ValueError("accelerate launch set both ACCELERATE_USE_FSDP and DeepSpeed; pick one of them")
        overrides["fsdp"], overrides["fsdp_config"] = fsdp_from_env(env, args.fsdp_config)
    if overrides:
        logger.info("accelerate launch's environment sets %s", sorted(overrides))
    return overrides


def deepspeed_config_from_env(env: Mapping[str, str]) -> dict | str:
    """The DeepSpeed config accelerate's DeepSpeedPlugin makes from the environment (see the module docstring)."""
    from gpuformers.training.deepspeed_config import DeepSpeedConfig

    accumulation = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
    clipping = env.get("ACCELERATE_GRADIENT_CLIPPING", "auto")
    settings = {
        "gradient_accumulation_steps": int(accumulation) if accumulation.isdigit() else accumulation,
        "gradient_clipping": clipping if clipping == "auto" else float(clipping),
        "zero_optimization.stage": int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2)),
        "zero_optimization.offload_optimizer.device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
        "zero_optimization.offload_param.device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"),
        "zero_optimization.stage3_gather_16bit_weights_on_model_save":
            _flag(env, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"),
    }
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        config = DeepSpeedConfig(path)  # the file's own values stand; the variables fill its "auto" ones only
        if "zero_optimization" not in config.config:
            raise ValueError(f"ACCELERATE_DEEPSPEED_CONFIG_FILE={path!r} has no zero_optimization section; add one "
                             '(e.g. "zero_optimization": {"stage": 2})')
        for key, value in settings.items():
            config.fill(key, value)
        return config.config
    config: dict[str, Any] = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": settings["gradient_accumulation_steps"],
                              "zero_optimization": {}}
    if settings["gradient_clipping"]:
        config["gradient_clipping"] = settings["gradient_clipping"]
    zero = config["zero_optimization"]
    zero["stage"] = settings["zero_optimization.stage"]
    for part, name in (("offload_optimizer", "OPTIMIZER"), ("offload_param", "PARAM")):
        device = settings[f"zero_optimization.{part}.device"]
        zero[part] = {"device": device}
        if device == "nvme":
            zero[part]["nvme_path"] = env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{name}_NVME_PATH", "none")
    zero["stage3_gather_16bit_weights_on_model_save"] = settings[
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"]
    return config


def fsdp_from_env(env: Mapping[str, str], fsdp_config: dict | None) -> tuple[str, dict]:
    """(fsdp, fsdp_config) from accelerate's FSDP_* variables (see the module docstring); `fsdp_config` given to the
    arguments is kept, the variables adding to it."""
    version = env.get("FSDP_VERSION", "1")
    if version != "2":
        logger.warning("FSDP_VERSION=%s: gpuformers shards with FSDP2, with the sharding strategy asked for", version)
    strategy = env.get("FSDP_SHARDING_STRATEGY") or env.get("FSDP_RESHARD_AFTER_FORWARD") or "FULL_SHARD"
    strategy = strategy.strip().upper()
    if strategy.lower() in _TRUE + _FALSE:  # FSDP2's reshard_after_forward: true is full sharding, false ZeRO-2
        option = "full_shard" if strategy.lower() in _TRUE else "shard_grad_op"
    elif strategy.isdigit() and 1 <= int(strategy) <= len(_SHARDING):
        option = list(_SHARDING.values())[int(strategy) - 1]
    elif strategy in _SHARDING:
        option = _SHARDING[strategy]
    else:
        raise ValueError(f"FSDP sharding strategy {strategy!r} (FSDP_SHARDING_STRATEGY / FSDP_RESHARD_AFTER_FORWARD) "
                         f"is not one of: {', '.join(_SHARDING)}, true, false")
    options = [option] + (["offload"] if _flag(env, "FSDP_OFFLOAD_PARAMS") else [])
    from gpuformers.training.fsdp_config import load_fsdp_config

    config = dict(load_fsdp_config(fsdp_config))
    config["auto_wrap_policy"] = env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    if config["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        config["transformer_layer_cls_to_wrap"] = env["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")
    if config["auto_wrap_policy"] == "SIZE_BASED_WRAP":
        config["min_num_params"] = int(env.get("FSDP_MIN_NUM_PARAMS", 0))
    if _flag(env, "FSDP_ACTIVATION_CHECKPOINTING"):
        config["activation_checkpointing"] = True
    return " ".join(options), config
