"""How FSDP2 shards a model for the Trainer: TrainingArguments' `fsdp` and `fsdp_config`, checked, as one
`distributed.FSDPOptions`.

`fsdp` takes transformers' options, `fsdp_config` (a dict or a JSON file) transformers' and accelerate's FSDP2
keys (the "fsdp_" prefix optional); both become one `distributed.FSDPOptions`:

    fsdp="full_shard" (or True)    reshard_after_forward=True          ZeRO-3: gathered per layer, freed after
    fsdp="shard_grad_op"           reshard_after_forward=False         ZeRO-2: kept gathered until the backward
    fsdp="hybrid_shard"            2-D mesh, reshard_after_forward     sharded inside a node, replicated across
    fsdp="hybrid_shard_zero2"      2-D mesh, no reshard after forward
    + "offload"                    CPUOffloadPolicy                    also fsdp_config cpu_offload / offload_params
    + "auto_wrap"                  (always: one group per decoder layer, then the root)
    fsdp_config: version (2), reshard_after_forward, cpu_offload, offload_params, activation_checkpointing
    (= gradient_checkpointing), auto_wrap_policy (TRANSFORMER_BASED_WRAP or NO_WRAP), transformer_layer_cls_to_wrap,
    mixed_precision_policy (accelerate's: "bf16" / "fp16" / "fp32" or {param_dtype, reduce_dtype, output_dtype}),
    dp_shard_size (accelerate's name: the processes of one hybrid group; default LOCAL_WORLD_SIZE), and at their
    defaults min_num_params, state_dict_type, cpu_ram_efficient_loading, xla*. Other keys, FSDP1's included, are
    refused by name.

Offers: FSDP_OPTIONS, FSDP_CONFIG_KEYS, load_fsdp_config, fsdp_options.
"""

from __future__ import annotations

import json
import os
from typing import Any

# fsdp option -> reshard_after_forward (None: not a sharding strategy)
FSDP_OPTIONS = {"full_shard": True, "shard_grad_op": False, "hybrid_shard": True, "hybrid_shard_zero2": False,
                "offload": None, "auto_wrap": None}
FSDP_CONFIG_KEYS = ("version", "reshard_after_forward", "cpu_offload", "offload_params", "activation_checkpointing",
                    "auto_wrap_policy", "transformer_layer_cls_to_wrap", "mixed_precision_policy", "dp_shard_size",
                    "min_num_params", "state_dict_type", "cpu_ram_efficient_loading", "xla", "xla_fsdp_v2",
                    "xla_fsdp_grad_ckpt", "xla_fsdp_settings")
# transformers' FSDP1-only keys: FSDP2 has no such setting
_FSDP1_KEYS = ("sharding_strategy", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
               "limit_all_gathers")
_PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "float32": "float32"}


def load_fsdp_config(fsdp_config: dict | str | os.PathLike | None) -> dict[str, Any]:
    """fsdp_config as given: a dict, or the path of a JSON file read into one (as transformers does)."""
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, (str, os.PathLike)):
        with open(fsdp_config, encoding="utf-8") as f:
            fsdp_config = json.load(f)
    if not isinstance(fsdp_config, dict):
        raise ValueError(f"fsdp_config must be a dict or the path of a JSON file, not {type(fsdp_config).__name__}")
    return fsdp_config


def fsdp_options(fsdp: str | list | bool, fsdp_config: dict[str, Any]):
    """fsdp (options) and fsdp_config (a dict) -> (FSDPOptions, whether fsdp_config asks for activation
    checkpointing), every value checked (see the module docstring)."""
    from gpuformers.distributed import FSDPOptions

    # fsdp=True names no strategy: fsdp_config says, full sharding by default
    options = [] if fsdp is True else (
        fsdp.split() if isinstance(fsdp, str) else [str(getattr(o, "value", o)) for o in fsdp])
    config = _settings(fsdp_config)
    _refuse_unsupported(config)
    checkpointing = _flag("activation_checkpointing", config.get("activation_checkpointing", False))
    reshard, hybrid, dp_shard_size = _sharding(options, config)
    return FSDPOptions(reshard_after_forward=reshard, hybrid_shard=hybrid, dp_shard_size=dp_shard_size,
                       cpu_offload=_offload(options, config), layer_classes=_layer_classes(config),
                       mixed_precision=_mixed_precision(config.get("mixed_precision_policy"))), checkpointing


def _settings(fsdp_config: dict[str, Any]) -> dict[str, Any]:
    """fsdp_config with the "fsdp_" prefixes dropped; FSDP1 and unknown keys refused by name."""
    config = {k.removeprefix("fsdp_"): v for k, v in fsdp_config.items()}
    if old := [k for k in config if k in _FSDP1_KEYS]:
        raise ValueError(f"fsdp_config {old} are FSDP1 settings; gpuformers shards with FSDP2, which has none: "
                         "drop them (name the strategy in fsdp, e.g. fsdp='hybrid_shard')")
    if unknown := [k for k in config if k not in FSDP_CONFIG_KEYS]:
        raise ValueError(f"fsdp_config keys {unknown} are not understood; the keys are: {', '.join(FSDP_CONFIG_KEYS)}")
    if int(config.get("version", 2)) != 2:
        raise ValueError(f"fsdp_config version={config['version']!r}: gpuformers shards with FSDP2 only; drop "
                         "version or set it to 2")
    return config


def _sharding(options: list[str], config: dict[str, Any]) -> tuple[bool, bool, int | None]:
    """The fsdp options' sharding strategy with fsdp_config's reshard_after_forward and dp_shard_size ->
    (reshard_after_forward, hybrid_shard, dp_shard_size)."""
    if "no_shard" in options:
        raise ValueError("fsdp='no_shard' keeps whole copies of the model in every process: that is DDP, which "
                         "torchrun runs without fsdp; drop fsdp")
    if unknown := [o for o in options if o not in FSDP_OPTIONS]:
        raise ValueError(f"fsdp options {unknown} are not among: {', '.join(FSDP_OPTIONS)}")
    strategies = [o for o in options if FSDP_OPTIONS[o] is not None]
    if len(strategies) > 1:
        raise ValueError(f"fsdp names {len(strategies)} sharding strategies {strategies}; keep one of them")
    strategy = strategies[0] if strategies else None
    reshard = FSDP_OPTIONS[strategy] if strategy else True
    if "reshard_after_forward" in config:
        asked = _flag("reshard_after_forward", config["reshard_after_forward"])
        if strategy and asked != reshard:
            raise ValueError(f"fsdp={strategy!r} means reshard_after_forward={reshard}, but fsdp_config says "
                             f"{asked}; drop one (shard_grad_op / hybrid_shard_zero2 keep parameters gathered)")
        reshard = asked
    hybrid = bool(strategy and strategy.startswith("hybrid"))
    dp_shard_size = config.get("dp_shard_size")
    if dp_shard_size is not None:
        if not hybrid:
            raise ValueError(f"fsdp_config dp_shard_size={dp_shard_size} sizes hybrid sharding groups, but fsdp "
                             f"is {' '.join(options) or True!r}; add 'hybrid_shard' (or 'hybrid_shard_zero2') to fsdp")
        if not isinstance(dp_shard_size, int) or dp_shard_size < 1:
            raise ValueError(f"fsdp_config dp_shard_size={dp_shard_size!r} must be a whole number >= 1 (the "
                             "processes per node, typically)")
    return reshard, hybrid, dp_shard_size


def _offload(options: list[str], config: dict[str, Any]) -> bool:
    """CPU offload, asked for by fsdp's "offload" or fsdp_config's cpu_offload / offload_params (which must agree)."""
    flags = {k: _flag(k, config[k]) for k in ("cpu_offload", "offload_params") if k in config}
    if "offload" in options:
        flags["fsdp='... offload'"] = True
    if len(set(flags.values())) > 1:
        raise ValueError(f"CPU offload is both asked for and refused: {flags}; keep one setting")
    return any(flags.values())


def _layer_classes(config: dict[str, Any]) -> tuple[str, ...] | None:
    """The classes sharded one by one: transformer_layer_cls_to_wrap, none with NO_WRAP (one group), or None for
    the model's own no_split_modules."""
    classes = config.get("transformer_layer_cls_to_wrap")
    classes = (classes,) if isinstance(classes, str) else tuple(classes) if classes is not None else None
    wrap = str(config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if wrap == "NO_WRAP":
        if classes:
            raise ValueError(f"fsdp_config auto_wrap_policy NO_WRAP shards the model as one group, but "
                             f"transformer_layer_cls_to_wrap names {list(classes)}; drop one of them")
        return ()
    if wrap == "SIZE_BASED_WRAP":
        raise NotImplementedError("fsdp_config auto_wrap_policy SIZE_BASED_WRAP is not implemented; use "
                                  "TRANSFORMER_BASED_WRAP (one group per decoder layer, the default)")
    if wrap != "TRANSFORMER_BASED_WRAP":
        raise ValueError(f"fsdp_config auto_wrap_policy {wrap!r} is not one of: TRANSFORMER_BASED_WRAP, NO_WRAP, "
                         "SIZE_BASED_WRAP")
    return classes


def _refuse_unsupported(config: dict[str, Any]) -> None:
    """transformers' fsdp_config keys that gpuformers accepts at their defaults only."""
    if config.get("min_num_params", 0):
        raise NotImplementedError(f"fsdp_config min_num_params={config['min_num_params']} asks for size-based "
                                  "wrapping, which is not implemented; drop it (one group per decoder layer)")
    state_dict_type = str(config.get("state_dict_type", "FULL_STATE_DICT")).upper()
    if state_dict_type != "FULL_STATE_DICT":
        raise NotImplementedError(f"fsdp_config state_dict_type {state_dict_type!r}: checkpoints are written whole "
                                  "(FULL_STATE_DICT) only, loadable by from_pretrained; drop it")
    for key in ("cpu_ram_efficient_loading", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):
        if key in config and _flag(key, config[key]):
            raise NotImplementedError(f"fsdp_config {key}={config[key]!r} is not implemented; drop it")
    if config.get("xla_fsdp_settings"):
        raise NotImplementedError("fsdp_config xla_fsdp_settings: XLA is not supported; drop it")


def _flag(name: str, value: Any) -> bool:
    """A yes/no setting from a dict or a JSON file: a bool, or the strings transformers accepts ("true", "1", ...)."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "1", "yes", "y", "on"):
        return True
    if text in ("false", "0", "no", "n", "off"):
        return False
    raise ValueError(f"fsdp_config {name}={value!r} is not a yes/no value; pass true or false")


def _mixed_precision(policy: Any) -> dict[str, str] | None:
    """fsdp_config mixed_precision_policy (accelerate's forms) -> {param_dtype, reduce_dtype, output_dtype: name}."""
    if policy is None:
        return None

    def name(value: Any) -> str:
        value = str(value).removeprefix("torch.")
        if value not in _PRECISIONS:
            raise ValueError(f"fsdp_config mixed_precision_policy dtype {value!r} is not one of: "
                             f"{', '.join(_PRECISIONS)}")
        return _PRECISIONS[value]

    if isinstance(policy, dict):
        keys = ("param_dtype", "reduce_dtype", "output_dtype")
        if unknown := [k for k in policy if k not in keys]:
            raise ValueError(f"fsdp_config mixed_precision_policy keys {unknown} are not among: {', '.join(keys)}")
        return {k: name(v) for k, v in policy.items()}
    dtype = name(policy)  # one name: parameters gathered in it, gradients reduced in it (accelerate's meaning)
    return {"param_dtype": dtype, "reduce_dtype": dtype, "output_dtype": dtype}
