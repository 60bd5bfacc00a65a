"""The environment report and the setup checks behind `gpuformers env` and `gpuformers doctor`.

Offers:
- `env_report()` -> dict: everything `gpuformers env` shows (versions, CUDA variables, GPUs joined to nvidia-smi's)
- `Finding`: one checked line, level "ok" / "info" / "warn" / "fail" and its fix
- `doctor(report)` -> list of `Finding`; `gpu_mapping(report)`: "cuda:i -> nvidia-smi j -> bus id" lines
- `backend_report(report, environ)` -> per attention backend and kernel set: whether it can run here and why not

GPU discovery itself (`gpu_info`, `nvidia_gpus`, `visible_devices_problems`) lives in gpuformers.device; this file
only reads it. torch is imported inside `env_report`, so that a broken torch install is reported, not raised.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any, Callable

from gpuformers.device import (GPUS_FLAG_VARIABLE, NvidiaReport, arch_supported, gpu_info, nvidia_gpus,
                               visible_devices_problems)
from gpuformers.sizes import format_size

# (oldest Linux driver, newest CUDA it runs, the torch wheel index for it), newest first. A CUDA major runs on the
# driver of its x.0 (13.x: 580, 12.x: 525, 11.x: 450) by minor version compatibility (CUDA toolkit release notes),
# so a 535 driver runs the cu126 wheels.
_DRIVERS = [(580, "13.0", "cu130"), (570, "12.8", "cu128"), (525, "12.6", "cu126"), (450, "11.8", "cu118")]
_MIN_DRIVER = {13: 580, 12: 525, 11: 450}


def _driver_major(driver: str | None) -> int | None:
    head = (driver or "").split(".")[0]
    return int(head) if head.isdigit() else None


def _wheel_for(driver: str | None) -> tuple[str, str] | None:
    """(newest CUDA, wheel index suffix) that a driver "570.86.10" runs, or None when unknown."""
    major = _driver_major(driver)
    return next(((cuda, wheel) for oldest, cuda, wheel in _DRIVERS if major is not None and major >= oldest), None)


def _package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)  # reads metadata only: importing bitsandbytes is slow and noisy
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def env_report(*, cuda: Any = None, probe_nvidia: Callable[[], NvidiaReport | None] = nvidia_gpus,
               environ: Any = None, versions: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything `gpuformers env` prints, as plain data (json-ready). `versions` overrides detected versions."""
    import gpuformers

    environ = os.environ if environ is None else environ
    nvidia = probe_nvidia()
    report: dict[str, Any] = {
        "versions": {"python": platform.python_version(), "gpuformers": gpuformers.__version__, "torch": None,
                     "torch_cuda": None, "driver": nvidia.driver if nvidia else None,
                     "triton": _package_version("triton", "pytorch-triton", "triton-windows"),
                     "flash_attn": _package_version("flash-attn", "flash-attn-3"),
                     "bitsandbytes": _package_version("bitsandbytes")},
        "torch_error": None, "cuda_available": False, "device_count": 0, "cuda_error": None, "arch_list": [],
        "environ": {name: environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")},
        "gpus_flag": environ.get(GPUS_FLAG_VARIABLE),
        "gpus": [],
        "nvidia": None if nvidia is None else {"source": nvidia.source, "gpus": [asdict(g) for g in nvidia.gpus]},
        "backends": [],
    }
    try:
        import torch

        report["versions"].update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        cuda = torch.cuda if cuda is None else cuda
    except Exception as error:  # a broken wheel or a missing CUDA library: report it, do not crash
        report["torch_error"] = f"{type(error).__name__}: {error}"
    report["versions"].update(versions or {})
    if cuda is None:
        return report
    report["cuda_available"] = bool(cuda.is_available())
    report["device_count"] = cuda.device_count() if report["cuda_available"] else 0
    if not report["cuda_available"] and report["versions"]["torch_cuda"] and nvidia and nvidia.gpus:
        try:
            cuda.init()  # torch.cuda.is_available() hides the reason; init() raises it
        except Exception as error:
            report["cuda_error"] = f"{type(error).__name__}: {error}"
    by_bus = {g.pci_bus_id: g.index for g in nvidia.gpus} if nvidia else {}
    by_uuid = {g.uuid: g.index for g in nvidia.gpus} if nvidia else {}  # torch < 2.6 has no PCI fields, only uuid
    gpus = gpu_info(cuda)
    if gpus and hasattr(cuda, "get_arch_list"):
        report["arch_list"] = list(cuda.get_arch_list())  # the GPU architectures this torch has kernels for
    for gpu in gpus:
        index = by_bus.get(gpu.pci_bus_id, by_uuid.get(gpu.uuid))
        report["gpus"].append({**asdict(gpu), "nvidia_smi_index": index,
                               "torch_supports": arch_supported(gpu.capability, report["arch_list"])})
    report["backends"] = backend_report(report, environ)
    return report


def backend_report(report: dict[str, Any], environ: Any) -> list[dict[str, Any]]:
    """Each attention backend and kernel set, judged for cuda:0 (or the CPU when no GPU is visible):
    {"kind": "attention" | "kernels", "name", "runs": bool, "why": "" or why not, with the fix}. Only called once
    torch imported (the flash backends' rules live beside them in layers/flash_attention.py)."""
    import importlib.util

    from gpuformers.kernels.hub_kernels import kernels_package_missing
    from gpuformers.layers.flash_attention import flash_attn_usable

    capability = tuple(report["gpus"][0]["capability"]) if report["gpus"] else None
    where = "cuda:0 ({}.{})".format(*capability) if capability else "the CPU"
    if not report["versions"].get("triton"):
        triton = "triton is not installed (pip install 'gpuformers[kernels]')"
    elif capability is None:
        triton = ("" if environ.get("TRITON_INTERPRET", "0") not in ("", "0") else
                  "no GPU: the Triton kernels are for NVIDIA GPUs (the CPU runs them only under TRITON_INTERPRET=1, "
                  "for tests)")
    elif capability < (7, 0):
        triton = f"Triton needs compute capability 7.0, {where} is older"
    else:
        triton = ""
    flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    hub = kernels_package_missing()
    rows = [("attention", "sdpa", "", "the default"), ("attention", "eager", "", ""),
            ("attention", "flex_attention", "" if flex else "this torch has no torch.nn.attention.flex_attention", ""),
            ("attention", "triton", triton, "")]
    for name in ("flash_attention_2", "flash_attention_3", "flash_attention_4"):
        why = flash_attn_usable(name, capability)
        rows.append(("attention", name, why + (" (asked for, it falls back to 'triton' with a warning)"
                                               if why and capability else ""), ""))
    rows += [("attention", "Hub kernel 'org/repo'", hub, ""),
             ("kernels", "use_kernels=True (Triton: RMSNorm, SwiGLU, rotary, losses, MoE)", triton, ""),
             ("kernels", "KernelConfig Hub / local kernels 'org/repo:Layer'", hub, "")]
    return [{"kind": kind, "name": name, "where": where, "runs": not why, "why": why or note}
            for kind, name, why, note in rows]


@dataclass(frozen=True)
class Finding:
    """One line of `gpuformers doctor`: level "ok", "info", "warn" or "fail", and how to fix it."""

    level: str
    check: str
    message: str
    fix: str | None = None


def gpu_mapping(report: dict[str, Any]) -> list[str]:
    """ "cuda:0 -> nvidia-smi 2 -> 00000000:3B:00.0" for each visible GPU."""
    return [f"cuda:{g['index']} -> nvidia-smi {'?' if g['nvidia_smi_index'] is None else g['nvidia_smi_index']} "
            f"-> {g['pci_bus_id'] or 'PCI bus unknown'} ({g['name']})" for g in report["gpus"]]


def doctor(report: dict[str, Any]) -> list[Finding]:
    """Check an env_report for what goes wrong in practice. A "fail" makes `gpuformers doctor` exit non-zero.

    It sees this process's environment only: a CUDA_VISIBLE_DEVICES exported in the shell and one set for a single
    command look the same from here, so any value not set by --gpus gets the warning (docs/gpus.md).
    """
    found: list[Finding] = []
    versions, env, gpus = report["versions"], report["environ"], report["gpus"]
    physical = report["nvidia"]["gpus"] if report["nvidia"] else []
    visible, order = env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]

    if report["torch_error"]:
        found.append(Finding("fail", "torch", f"import torch fails: {report['torch_error']}",
                             "reinstall torch for your CUDA (https://pytorch.org/get-started/locally/)"))
    elif physical and versions["torch_cuda"] is None:
        cuda, wheel = _wheel_for(versions["driver"]) or ("that nvidia-smi shows", "cu126")
        found.append(Finding("fail", "torch", f"nvidia-smi lists {len(physical)} GPU(s) but torch "
                             f"{versions['torch']} is a CPU-only build", "install a CUDA build of torch: "
                             f"pip install torch --index-url https://download.pytorch.org/whl/{wheel} (driver "
                             f"{versions['driver'] or 'unknown'} runs CUDA {cuda} and older)"))
    else:
        found.append(Finding("ok", "torch", f"torch {versions['torch']} imports"
                             + (f", built for CUDA {versions['torch_cuda']}" if versions["torch_cuda"] else "")))

    if visible is not None:
        problems = visible_devices_problems(visible, len(physical) or None, tuple(g["uuid"] for g in physical))
        from_flag = report["gpus_flag"] == visible
        if problems:
            found.append(Finding("fail", "CUDA_VISIBLE_DEVICES", f"CUDA_VISIBLE_DEVICES={visible!r} is invalid: "
                                 + "; ".join(problems) + " (CUDA silently drops that entry and all after it)",
                                 "use indices as nvidia-smi lists them, e.g. --gpus 0,1"))
        elif visible.strip() in ("", "-1"):
            found.append(Finding("info" if from_flag else "warn", "CUDA_VISIBLE_DEVICES",
                                 f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU: runs use the CPU",
                                 None if from_flag else 'unset CUDA_VISIBLE_DEVICES, or use --gpus "" for one run'))
        if from_flag:
            found.append(Finding("ok", "CUDA_VISIBLE_DEVICES", f"GPUs {visible!r} chosen by --gpus for this run"))
        else:
            found.append(Finding("warn", "CUDA_VISIBLE_DEVICES", f"CUDA_VISIBLE_DEVICES={visible!r} is set in the "
                                 "environment; if it is exported, every later command in this shell inherits it",
                                 "unset CUDA_VISIBLE_DEVICES and pass --gpus (or set it in front of one command: "
                                 "CUDA_VISIBLE_DEVICES=0 cmd); `export -p | grep CUDA_` shows what is exported"))
    else:
        found.append(Finding("ok", "CUDA_VISIBLE_DEVICES", "not set: every GPU is visible"))

    if order not in (None, "FASTEST_FIRST", "PCI_BUS_ID"):
        found.append(Finding("warn", "CUDA_DEVICE_ORDER", f"CUDA_DEVICE_ORDER={order!r} is not a value CUDA knows; "
                             "it falls back to FASTEST_FIRST", "export CUDA_DEVICE_ORDER=PCI_BUS_ID"))
    elif max(len(physical), len(gpus)) > 1 and order != "PCI_BUS_ID":
        moved = [g for g in gpus if g["nvidia_smi_index"] not in (None, g["index"])]
        found.append(Finding("warn", "CUDA_DEVICE_ORDER", "several GPUs and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA "
                             "numbers them fastest first, so cuda:i and CUDA_VISIBLE_DEVICES indices may not be "
                             "nvidia-smi's" + (" (here they differ)" if moved else "") + "\n" + "\n".join(gpu_mapping(report)),
                             "export CUDA_DEVICE_ORDER=PCI_BUS_ID (--gpus sets it for its run)"))

    if report["cuda_available"]:
        found.append(Finding("ok", "CUDA", f"torch.cuda.is_available() True, {report['device_count']} GPU(s)"))
    elif physical and versions["torch_cuda"] and not (visible is not None and visible.strip() in ("", "-1")):
        driver, needed = versions["driver"], _MIN_DRIVER.get(int(versions["torch_cuda"].split(".")[0]))
        if _driver_major(driver) is not None and needed is not None and _driver_major(driver) < needed:
            cuda, wheel = _wheel_for(driver) or ("11 or older", "cu118")
            fix = (f"NVIDIA driver {driver} is too old for torch's CUDA {versions['torch_cuda']}, which needs driver "
                   f">= {needed}: update the driver, or install a torch built for CUDA {cuda} (pip install torch "
                   f"--index-url https://download.pytorch.org/whl/{wheel})")
        else:
            fix = (f"update the NVIDIA driver (torch needs one for CUDA {versions['torch_cuda']}), or in a container "
                   "start it with --gpus all")
        found.append(Finding("fail", "CUDA", f"nvidia-smi lists {len(physical)} GPU(s) but torch cannot use them: "
                             f"{report['cuda_error'] or 'torch.cuda.is_available() is False'}", fix))
    elif physical:
        found.append(Finding("info", "CUDA", f"torch sees none of the {len(physical)} GPU(s) nvidia-smi lists "
                             "(see above): gpuformers runs on the CPU"))
    else:
        found.append(Finding("info", "CUDA", "no CUDA GPU: gpuformers runs on the CPU"))

    for gpu in gpus:
        if gpu.get("torch_supports") is False:
            sm = "sm_{}{}".format(*gpu["capability"])
            found.append(Finding("fail", "capability", f"cuda:{gpu['index']} {gpu['name']} is {sm}, which torch "
                                 f"{versions['torch']} (CUDA {versions['torch_cuda']}) has no kernels for (it has: "
                                 f"{' '.join(report['arch_list'])}); every CUDA op fails with 'no kernel image is "
                                 "available'", f"install a torch whose torch.cuda.get_arch_list() includes {sm}: CUDA "
                                 "13 builds start at sm_75, CUDA 12 builds (--index-url "
                                 "https://download.pytorch.org/whl/cu126) reach back further"))
        if not gpu["bf16"]:
            major, minor = gpu["capability"]
            # Triton (so use_kernels=True and torch.compile's inductor) needs 7.0: torch._inductor GPUTooOldForTriton
            triton = ", no Triton kernels and no torch.compile (Triton needs 7.0)" if (major, minor) < (7, 0) else ""
            found.append(Finding("warn", "capability", f"cuda:{gpu['index']} {gpu['name']} has compute capability "
                                 f"{major}.{minor} < 8.0: no bfloat16 (dtype='auto' picks float16), no "
                                 f"FlashAttention 2{triton}", "use attn_implementation='sdpa'; bfloat16 needs an "
                                 "Ampere or newer GPU"))
        total, free = gpu["total_memory"], gpu["free_memory"]
        if free is None or free < total / 2:
            # another process's memory: CUDA's free is the whole GPU's, and nvidia-smi's process list names the owner
            found.append(Finding("warn", "memory", f"cuda:{gpu['index']} {gpu['name']} (nvidia-smi "
                                 f"{'?' if gpu['nvidia_smi_index'] is None else gpu['nvidia_smi_index']}): "
                                 + ("free memory unknown (CUDA could not create a context: full, or in exclusive "
                                    "mode)" if free is None else f"only {format_size(free)} of {format_size(total)} "
                                    "free: other processes use it"),
                                 "`nvidia-smi` lists the processes on each GPU; pick idle GPUs with --gpus"))
    for package, what in (("triton", "the fused kernels (use_kernels=True)"),
                          ("flash_attn", "attn_implementation='flash_attention_2'")):
        if versions[package]:
            found.append(Finding("ok", package, f"{package} {versions[package]}"))
        elif gpus:
            found.append(Finding("warn", package, f"{package} is not installed: {what} is unavailable",
                                 f"pip install {'triton' if package == 'triton' else 'flash-attn --no-build-isolation'}"))
        else:
            found.append(Finding("info", package, f"{package} is not installed (only needed on a GPU)"))
    for backend in report.get("backends", []):  # each backend and kernel set: can it run here, and why not
        if backend["runs"]:
            found.append(Finding("ok", backend["kind"], f"{backend['name']} runs on {backend['where']}"))
        else:
            found.append(Finding("info", backend["kind"], f"{backend['name']} cannot run on {backend['where']}: "
                                 f"{backend['why']}"))
    return found
