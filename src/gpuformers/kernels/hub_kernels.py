"""Kernels from the Hugging Face Hub or a local folder, through the `kernels` package (extra `hub-kernels`), named
the way transformers names them.

Spellings (one string, or a (string, {"revision": ..., "version": ..., "trust_remote_code": ...}) pair):

    "org/repo:Layer"        the class `Layer` in the kernel's `layers` module; its forward replaces the layer's
    "org/repo@rev:Layer"    the same at a branch, tag or commit (else version 1, as transformers asks)
    "/path/to/kernel:Layer" with KernelConfig(..., use_local_kernel=True): a folder in the kernels layout
                            (build/<variant>/<package>/__init__.py with a layers submodule, and metadata.json)
    "org/repo"              as attn_implementation: an attention kernel with flash_attn_func (flash-attn 2's
    "org/repo:function"     interface), or the named function written as an AttentionInterface backend

Trust: the `kernels` package imports and runs the kernel's Python code, which is the user's explicit choice when
they name a repo. Repos of the `kernels-community` organisation are accepted by name; any other repo must be
trusted explicitly (trust_remote_code=True in its pair, or allow_all_kernels=True for attention), and that is
checked here, online and offline alike, before the `kernels` package is asked for anything. A local folder is the
user's own path, named explicitly with use_local_kernel=True.

Offline (HF_HUB_OFFLINE=1) a repo is read from the Hugging Face cache (HF_HUB_CACHE, or KERNELS_CACHE as the
`kernels` package reads it); one that is not there fails naming the repo and the command that fetches it.

Offers: TRUSTED_ORGANISATION, HubKernelSpec, parse_kernel, looks_like_hub_kernel, load_kernel_module,
kernel_layer_forward, kernels_package_missing.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

TRUSTED_ORGANISATION = "kernels-community"
EXTRA = "hub-kernels"
_OFFLINE_VALUES = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubKernelSpec:
    """One named kernel: a Hub repo (with its revision or version) or a local folder, and the name inside it."""

    source: str  # "org/repo", or a folder when local
    name: str | None  # the layer class, or the attention function (None: the module's flash_attn_func)
    revision: str | None = None
    version: int | None = None
    trust_remote_code: bool = False
    local: bool = False

    def __str__(self) -> str:
        where = self.source if self.local or self.revision is None else f"{self.source}@{self.revision}"
        return where if self.name is None else f"{where}:{self.name}"


def looks_like_hub_kernel(value) -> bool:
    """A mapping value that names a Hub repo or a folder (has a '/' or a ':'), not "triton" or "torch"."""
    value = value[0] if isinstance(value, tuple) and value else value
    return isinstance(value, str) and ("/" in value or ":" in value)


def parse_kernel(value, *, local: bool = False, need_name: bool = True) -> HubKernelSpec:
    """ "org/repo:Layer", "org/repo@rev:Layer", ("org/repo:Layer", {metadata}) or, local, "/path:Layer"."""
    metadata = {}
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], dict):
            raise ValueError(f"a kernel given as a tuple must be (\"org/repo:Layer\", {{\"version\": 1, ...}}), "
                             f"got {value!r}")
        value, metadata = value
        unknown = set(metadata) - {"revision", "version", "trust_remote_code"}
        if unknown:
            raise ValueError(f"kernel {value!r}: unknown metadata {sorted(unknown)}; the keys are revision, version "
                             f"and trust_remote_code")
    if not isinstance(value, str) or not value:
        raise ValueError(f"a kernel must be named as 'org/repo:Layer' (or '/path/to/kernel:Layer' with "
                         f"use_local_kernel=True), got {value!r}")
    source, colon, name = value.rpartition(":") if ":" in value else (value, "", "")
    if need_name and not (colon and name):
        raise ValueError(f"kernel {value!r} names no layer: write 'org/repo:Layer' (the class in the kernel's "
                         f"layers module)")
    if local:
        return HubKernelSpec(str(Path(source).expanduser()), name or None, local=True)
    repo, _, at_revision = source.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        hint = " (a local folder needs use_local_kernel=True)" if Path(repo).is_absolute() else ""
        raise ValueError(f"kernel {value!r}: {repo!r} is not a Hub repo id 'org/repo'{hint}")
    revision, version = metadata.get("revision") or at_revision or None, metadata.get("version")
    if revision is not None and version is not None:
        raise ValueError(f"kernel {value!r}: give a revision or a version, not both")
    trust = metadata.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise ValueError(f"kernel {value!r}: trust_remote_code must be True or False, got {trust!r}")
    return HubKernelSpec(repo, name or None, revision, version if revision is None else None, trust)


def kernels_package_missing() -> str:
    """'' when the `kernels` package is importable, else the words that say how to get it."""
    if importlib.util.find_spec("kernels") is None:
        return f"the kernels package is not installed (pip install 'gpuformers[{EXTRA}]', or pip install kernels)"
    return ""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in _OFFLINE_VALUES


def _check_trust(spec: HubKernelSpec, allow_all_kernels: bool) -> None:
    if spec.local or spec.trust_remote_code or allow_all_kernels:
        return
    if spec.source.split("/", 1)[0] != TRUSTED_ORGANISATION:
        raise ValueError(
            f"kernel repo {spec.source!r} is outside {TRUSTED_ORGANISATION!r}, and loading it runs its code: trust "
            f"it explicitly with ({str(spec)!r}, {{\"version\": 1, \"trust_remote_code\": True}}) in the "
            f"KernelConfig (attn_implementation: from_pretrained(..., allow_all_kernels=True))"
        )


@functools.lru_cache(maxsize=None)
def _load(spec: HubKernelSpec, allow_all_kernels: bool) -> ModuleType:
    # `kernels` is optional (extra hub-kernels): imported only when a user names a Hub or local kernel
    import kernels

    if spec.local:
        if not (Path(spec.source) / "build").is_dir():
            raise FileNotFoundError(f"local kernel folder {spec.source!r} has no build/ folder: the kernels layout "
                                    f"is build/<variant>/<package>/__init__.py (variant e.g. torch-universal)")
        return kernels.get_local_kernel(Path(spec.source))
    # version 1 when neither is given, as transformers asks (a kernel's major version is a branch v1, v2, ...)
    version = spec.version if spec.revision is not None or spec.version is not None else 1
    return kernels.get_kernel(spec.source, revision=spec.revision, version=None if spec.revision else version,
                              trust_remote_code=spec.trust_remote_code or allow_all_kernels)


def load_kernel_module(spec: HubKernelSpec, *, allow_all_kernels: bool = False) -> ModuleType:
    """The kernel's Python module (loaded once per spec), after the trust rule; errors name the repo and the fix."""
    _check_trust(spec, allow_all_kernels)
    missing = kernels_package_missing()
    if missing:
        raise ImportError(f"kernel {str(spec)!r} needs {missing}")
    try:
        return _load(spec, allow_all_kernels)
    except (ValueError, FileNotFoundError, OSError) as error:
        if spec.local or not _offline():
            raise
        cache = os.environ.get("KERNELS_CACHE") or os.environ.get("HF_HUB_CACHE") or "the Hugging Face cache"
        raise FileNotFoundError(
            f"kernel repo {spec.source!r} ({'revision ' + spec.revision if spec.revision else 'version ' + str(spec.version or 1)}) "
            f"is not in {cache} and HF_HUB_OFFLINE=1 forbids downloading it; fetch it once online with "
            f"`kernels download` in a project that locks it, or python -c \"from kernels import get_kernel; "
            f"get_kernel('{spec.source}', version={spec.version or 1})\", then run offline again ({error})"
        ) from error


def kernel_layer_forward(spec: HubKernelSpec, layer_class: type) -> Callable:
    """The forward of the kernel's `layers.<name>` class, to run with the model's layer as `self`: the kernel class
    may only read what the layer has (its weights and settings), so it must define no __init__ of its own."""
    module = load_kernel_module(spec)
    layers = getattr(module, "layers", None)
    kernel_class = getattr(layers, spec.name, None) if layers is not None else None
    if not isinstance(kernel_class, type) or not callable(getattr(kernel_class, "forward", None)):
        found = sorted(n for n in dir(layers) if isinstance(getattr(layers, n), type)) if layers is not None else []
        raise ValueError(f"kernel {str(spec)!r} has no layer class {spec.name!r} in its layers module; it has: "
                         f"{', '.join(found) or 'no layers module'}")
    if "__init__" in kernel_class.__dict__:
        raise TypeError(f"kernel layer {str(spec)!r} defines __init__: a kernel layer must only use the attributes "
                        f"of the layer it replaces ({layer_class.__name__})")
    want = _positional(layer_class.forward)
    have = _positional(kernel_class.forward)
    if len(want) != len(have):
        raise TypeError(f"kernel layer {str(spec)!r}.forward takes ({', '.join(have)}), but "
                        f"{layer_class.__name__}.forward takes ({', '.join(want)})")
    return kernel_class.forward


def _positional(fn: Callable) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds][1:]  # without self
