"""Devices and dtypes: the one place gpuformers asks which GPUs exist, which one to use and in which precision.

Offers:
- `parse_dtype(value)` -> torch.dtype or "auto"; `default_dtype(device)`; `resolve_dtype(dtype, checkpoint_dtype=, device=)`
- `resolve_device(device_or_map)` -> torch.device, with an error that says how to fix a missing GPU (never a CPU fallback)
- `mapped_devices(model)` / `is_offloaded(model)`: where device_map placed a loaded model, and whether some of it
  streams in from the CPU or disk
- `select_gpus("0,2")`: what `--gpus` does (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER=PCI_BUS_ID, before CUDA starts)
- `GPUInfo` / `gpu_info()`: the GPUs as CUDA numbers them; `NvidiaGPU` / `nvidia_gpus()`: as nvidia-smi numbers them
- `arch_supported(capability, torch.cuda.get_arch_list())`: whether this torch build has kernels for a GPU
- `visible_devices_problems(value)`: what is wrong with a CUDA_VISIBLE_DEVICES value
- `DEVICE_FORMS`: the device forms the errors list (the CLI rewrites that phrase into its --device values)

Two numberings meet here. CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, and only those that
CUDA_VISIBLE_DEVICES lets through; nvidia-smi (NVML) always numbers every GPU in PCI bus order. The PCI bus id is the
one name both agree on, so reports join the two on it.

Everything that asks CUDA takes `cuda=` (default `torch.cuda`): tests pass a fake with is_available(), device_count(),
get_device_properties(i), get_device_capability(i), mem_get_info(i), current_device() and is_initialized(), so that
4 GPUs in a wrong order can be simulated on a machine without one. torch is imported inside functions, not at the top,
so that `env` and `doctor` (gpuformers.doctor) still run, and explain, when `import torch` itself fails.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    import torch

_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
_DTYPE_CHOICES = "auto, float32, float16, bfloat16"
DEVICE_FORMS = ('None, "cpu", "cuda", "cuda:N", an int N (a GPU index), a torch.device, '
                'or a device map {"": one of these}')
# device_map strategies: they spread a model over every visible GPU, so dtype must suit all of them
_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
GPUS_FLAG_VARIABLE = "GPUFORMERS_GPUS"  # set by select_gpus, so doctor can tell --gpus from a variable set by hand


def _cuda(cuda: Any = None) -> Any:
    if cuda is not None:
        return cuda
    import torch

    return torch.cuda


# ----------------------------------------------------------------------------------------------------- dtypes


def parse_dtype(value: Any) -> torch.dtype | Literal["auto"]:
    """A dtype as users write it -> a torch.dtype, or "auto". None means "auto" (transformers 5's default)."""
    import torch

    if value is None:
        return "auto"
    if isinstance(value, torch.dtype):
        if value in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            return value
        raise ValueError(f"dtype {value} is not a compute dtype; use one of: {_DTYPE_CHOICES}")
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name == "auto":
            return "auto"
        if name in _DTYPE_ALIASES:
            return getattr(torch, _DTYPE_ALIASES[name])
    raise ValueError(f'dtype "{value}" is not one of: {_DTYPE_CHOICES}')


def _compute_devices(device: Any, cuda: Any) -> list[torch.device]:
    """Every device that will run layers: one for a device, several for a device map or a strategy."""
    import torch

    if isinstance(device, str) and device.strip().lower() in _STRATEGIES:
        gpus = _cuda(cuda)
        count = gpus.device_count() if gpus.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    if isinstance(device, dict) and set(device) != {""}:
        # "disk" holds weights that are streamed to the main device; it runs nothing itself
        return [resolve_device(v, cuda=cuda) for v in set(device.values()) if v != "disk"] or [torch.device("cpu")]
    return [resolve_device(device, cuda=cuda)]


def default_dtype(device: Any = None, *, cuda: Any = None) -> torch.dtype:
    """bfloat16 on CUDA compute capability >= 8.0, float16 on older GPUs, float32 on the CPU.

    With several GPUs (a device map or "auto"), the oldest one decides: bfloat16 only if every GPU has it.
    """
    import torch

    gpus = [d for d in _compute_devices(device, cuda) if d.type == "cuda"]
    if not gpus:
        return torch.float32
    if all(_cuda(cuda).get_device_capability(d.index) >= (8, 0) for d in gpus):
        return torch.bfloat16
    return torch.float16


def resolve_dtype(dtype: Any, *, checkpoint_dtype: Any = None, device: Any = None, cuda: Any = None) -> torch.dtype:
    """The dtype to load in. A dtype the user names wins; "auto" takes the checkpoint's (config.json `dtype` /
    `torch_dtype`) if known, except bfloat16 on a GPU without bfloat16 -> float16 with a warning; else default_dtype."""
    import torch

    chosen = parse_dtype(dtype)
    if chosen != "auto":
        return chosen
    if checkpoint_dtype is None:
        return default_dtype(device, cuda=cuda)
    try:
        stored = parse_dtype(checkpoint_dtype)
    except ValueError:
        raise ValueError(f'the checkpoint says dtype "{checkpoint_dtype}", which dtype="auto" cannot load in; '
                         f"pass dtype= one of: float32, float16, bfloat16") from None
    if stored == "auto":
        return default_dtype(device, cuda=cuda)
    if stored == torch.bfloat16:
        old = [d for d in _compute_devices(device, cuda) if d.type == "cuda"
               and _cuda(cuda).get_device_capability(d.index) < (8, 0)]
        if old:
            major, minor = _cuda(cuda).get_device_capability(old[0].index)
            warnings.warn(f"the checkpoint is bfloat16 but {old[0]} (compute capability {major}.{minor}) has no "
                          f"bfloat16 support: loading in float16 instead; pass dtype=torch.float32 to keep the "
                          f"full range", stacklevel=2)
            return torch.float16
    return stored


# ---------------------------------------------------------------------------------------------------- devices


def resolve_device(device_or_map: Any, *, cuda: Any = None) -> torch.device:
    """One device as users write it -> a torch.device that exists here, or an error saying how to fix it. "cuda"
    is the current GPU; under torchrun, this process's (cuda:LOCAL_RANK) until set_device says otherwise."""
    import torch

    value = device_or_map
    if isinstance(value, dict):
        if set(value) != {""}:
            raise ValueError(f"resolve_device takes one device, not a device map over several modules "
                             f"({sorted(value)[:3]}...); accepted: {DEVICE_FORMS}")
        value = value[""]
    if value is None:
        return torch.device("cpu")
    if isinstance(value, torch.device):
        kind, index = value.type, value.index
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        kind, index = "cuda", value
    elif isinstance(value, str) and (match := re.fullmatch(r"(cpu|cuda)(?::(\d+))?", value.strip().lower())):
        kind, index = match[1], None if match[2] is None else int(match[2])
    else:
        raise ValueError(f"device {value!r} is not understood; accepted: {DEVICE_FORMS}")
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"device {value!r} is not supported by gpuformers; accepted: {DEVICE_FORMS}")
    gpus = _cuda(cuda)
    if not gpus.is_available():
        raise RuntimeError(_no_cuda_message(value))
    count = gpus.device_count()
    if index is None:
        index = gpus.current_device()  # "cuda" means the current device (torch.cuda.set_device under torchrun)
        local_rank = os.environ.get("LOCAL_RANK", "")
        if index == 0 and local_rank.isdigit() and int(local_rank) < count:
            # Under torchrun before anything called set_device (a model loaded with device_map="cuda" before the
            # Trainer joins the process group): this process's GPU, not cuda:0 for every process
            index = int(local_rank)
    if index >= count:
        raise RuntimeError(f"device cuda:{index} does not exist: {count} CUDA GPU(s) are visible (cuda:0 to "
                           f"cuda:{count - 1}) with CUDA_VISIBLE_DEVICES={_shown(os.environ)}; pick an index below "
                           f"{count}, or choose other GPUs with --gpus (see `gpuformers env`)")
    return torch.device("cuda", index)


def mapped_devices(model: Any) -> set[str]:
    """The devices device_map (or tp_plan) placed a loaded model's modules on, as its hf_device_map writes them (0,
    "cuda:1", "cpu", "disk"), as strings; empty for a model loaded without one."""
    return {str(where) for where in (getattr(model, "hf_device_map", None) or {}).values()}


def is_offloaded(model: Any) -> bool:
    """Whether device_map put part of the model on disk, or on the CPU beside a GPU: those weights stream in through
    hooks at every forward (a model wholly on the CPU is not offloaded)."""
    places = mapped_devices(model)
    return "disk" in places or ("cpu" in places and len(places) > 1)


def _shown(environ: Any, name: str = "CUDA_VISIBLE_DEVICES") -> str:
    value = environ.get(name)
    return "(not set)" if value is None else repr(value)


def _no_cuda_message(requested: Any) -> str:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is None:
        fix = ("this torch is a CPU-only build: install a CUDA build (https://pytorch.org/get-started/locally/, "
               "matching the 'CUDA Version' nvidia-smi shows)")
    elif visible is not None and (visible.strip() in ("", "-1") or visible_devices_problems(visible)):
        fix = "CUDA_VISIBLE_DEVICES hides every GPU: unset it, or pass --gpus 0"
    else:
        fix = "check that `nvidia-smi` lists a GPU and that its driver supports CUDA " + torch.version.cuda
    return (f"device {requested!r} was asked for, but no CUDA GPU is visible (torch.cuda.is_available() is False; "
            f"CUDA_VISIBLE_DEVICES={_shown(os.environ)}, torch.version.cuda={torch.version.cuda!r}). Fix: {fix}; "
            f'or run on the CPU with device_map="cpu". `gpuformers doctor` checks the whole setup.')


def _split_gpus(value: str) -> list[str]:
    return [token.strip() for token in value.split(",")] if value.strip() else []


def select_gpus(gpus: str, *, environ: Any = None, cuda: Any = None) -> None:
    """`--gpus 0,2`: show only those GPUs (as nvidia-smi numbers them) to this process and its children.

    Must run before CUDA starts: CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises. `""` hides every GPU.
    """
    environ = os.environ if environ is None else environ
    tokens = _split_gpus(gpus)
    bad = [t for t in tokens if not (t.isdigit() or t.startswith(("GPU-", "MIG-")))]
    if bad or len(set(tokens)) != len(tokens):
        raise ValueError(f'--gpus "{gpus}" is not a comma-separated list of distinct GPU indices or UUIDs '
                         f'(e.g. --gpus 0,2 as nvidia-smi numbers them, or --gpus "" for the CPU)')
    current = environ.get("CUDA_VISIBLE_DEVICES")
    allowed = _split_gpus(current) if current is not None and current.strip() not in ("", "-1") else None
    outside = [t for t in tokens if allowed is not None and not any(_same_gpu(t, a) for a in allowed)]
    if outside:
        # a job scheduler (SLURM without device cgroups) or a parent run gave this process only these GPUs:
        # replacing the list would land on GPUs that belong to someone else
        raise ValueError(f'--gpus "{gpus}" picks {", ".join(outside)}, outside CUDA_VISIBLE_DEVICES={current!r} '
                         f"already set for this process (by a job scheduler, a parent run or an export): choose "
                         f"among {current}, in the same form (index or UUID), or unset CUDA_VISIBLE_DEVICES if "
                         f"the other GPUs are yours to use")
    torch = sys.modules.get("torch")  # not imported yet -> CUDA cannot have started
    if cuda is None and torch is not None:
        cuda = torch.cuda
    if cuda is not None and cuda.is_initialized():
        raise RuntimeError(f"--gpus {gpus} comes too late: CUDA is already initialised in this process, so it would "
                           f"keep the GPUs it saw; apply --gpus (select_gpus) before anything touches torch.cuda")
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(tokens)
    environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so that "0,2" means nvidia-smi's 0 and 2
    environ[GPUS_FLAG_VARIABLE] = ",".join(tokens)


def _same_gpu(token: str, other: str) -> bool:
    """Whether two CUDA_VISIBLE_DEVICES entries name the same GPU: equal, or one UUID abbreviating the other."""
    if token.startswith(("GPU-", "MIG-")) and other.startswith(("GPU-", "MIG-")):
        return token.startswith(other) or other.startswith(token)
    return token == other


def visible_devices_problems(value: str, gpu_count: int | None = None, uuids: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with a CUDA_VISIBLE_DEVICES value (empty list: nothing). "" and "-1" hide all GPUs on purpose.

    CUDA stops reading at the first bad entry and silently keeps the ones before it, hence a list of reasons.
    """
    if value.strip() in ("", "-1"):
        return []
    problems, seen = [], set()
    for token in (t.strip() for t in value.split(",")):
        if token in seen:
            problems.append(f"entry {token} appears twice")
        seen.add(token)
        if re.fullmatch(r"-?\d+", token):
            if int(token) < 0:
                problems.append(f"entry {token} is negative: it hides itself and every entry after it")
            elif gpu_count is not None and int(token) >= gpu_count:
                problems.append(f"entry {token} is past the last GPU (nvidia-smi lists {gpu_count}: 0 to {gpu_count - 1})")
        elif token.startswith(("GPU-", "MIG-")):
            # `uuids` are nvidia-smi --query-gpu's, whole GPUs only: a MIG instance's UUID is not among them
            if uuids and token.startswith("GPU-") and not any(u.startswith(token) for u in uuids):
                problems.append(f"no GPU has a UUID starting with {token}")
        else:
            problems.append(f"entry {token!r} is neither a GPU index nor a GPU-/MIG- UUID")
    return problems


# ------------------------------------------------------------------------------------------------ GPU discovery


@dataclass(frozen=True)
class GPUInfo:
    """One GPU as CUDA numbers it in this process (after CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER)."""

    index: int  # cuda:index
    name: str
    capability: tuple[int, int]
    total_memory: int  # bytes
    free_memory: int | None  # bytes; None when CUDA could not say (e.g. the GPU is full)
    bf16: bool  # native bfloat16: compute capability >= 8.0
    pci_bus_id: str | None  # nvidia-smi's spelling, "00000000:3B:00.0"
    uuid: str | None = None  # nvidia-smi's spelling, "GPU-8a1b..." (torch's str(props.uuid) lacks the prefix)


def _bus_id(domain: int, bus: int, device: int) -> str:
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def _normal_bus_id(text: str) -> str:
    """nvidia-smi says "00000000:3B:00.0", NVML may say "0000:3b:00.0": one spelling so that they compare."""
    match = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.\d", text.strip())
    return _bus_id(*(int(part, 16) for part in match.groups())) if match else text.strip()


def gpu_info(cuda: Any = None) -> list[GPUInfo]:
    """The GPUs this process can use, as cuda:0, cuda:1, ... Empty without CUDA."""
    cuda = _cuda(cuda)
    if not cuda.is_available():
        return []
    gpus = []
    for index in range(cuda.device_count()):
        props = cuda.get_device_properties(index)
        try:
            free = int(cuda.mem_get_info(index)[0])
        except Exception:  # a context cannot be created on a full or exclusive-mode GPU
            free = None
        pci = getattr(props, "pci_bus_id", None)  # torch >= 2.6; older builds lack the PCI fields
        bus = None if pci is None else _bus_id(getattr(props, "pci_domain_id", 0), pci, props.pci_device_id)
        uuid = str(getattr(props, "uuid", "") or "") or None
        if uuid and not uuid.startswith(("GPU-", "MIG-")):  # (a MIG instance's gets "GPU-" too, matching no GPU)
            uuid = f"GPU-{uuid}"
        gpus.append(GPUInfo(index=index, name=props.name, capability=(props.major, props.minor),
                            total_memory=int(props.total_memory), free_memory=free,
                            bf16=(props.major, props.minor) >= (8, 0), pci_bus_id=bus, uuid=uuid))
    return gpus


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool | None:
    """Whether a torch built for `arch_list` (torch.cuda.get_arch_list(): "sm_80", "sm_90a", "compute_120") has
    kernels for a GPU of `capability`; None when the list is empty (unknown). A cubin sm_XY runs on X.Y to X.9
    ("a": on X.Y only); PTX compute_XY is compiled at load time for any X.Y or newer. CUDA 13 builds (cu130)
    start at sm_75, so a V100 (7.0) is not among them."""
    if not arch_list:
        return None
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+?)(\d)([af]?)", arch.strip())
        if not match:
            continue
        kind, major, minor, suffix = match[1], int(match[2]), int(match[3]), match[4]
        if kind == "compute" and capability >= (major, minor):
            return True
        exact = suffix == "a"  # sm_90a: architecture-specific features, 9.0 only
        if kind == "sm" and capability[0] == major and (capability[1] == minor if exact else capability[1] >= minor):
            return True
    return False


@dataclass(frozen=True)
class NvidiaGPU:
    """One physical GPU as nvidia-smi numbers it (PCI bus order, blind to CUDA_VISIBLE_DEVICES)."""

    index: int
    pci_bus_id: str
    uuid: str
    name: str
    total_memory: int | None  # bytes
    free_memory: int | None  # bytes


@dataclass(frozen=True)
class NvidiaReport:
    source: str  # "nvidia-smi" or "nvml"
    driver: str | None
    gpus: list[NvidiaGPU]


_SMI_FIELDS = "index,pci.bus_id,uuid,name,memory.total,memory.free,driver_version"


def parse_nvidia_smi(text: str) -> NvidiaReport:
    """The output of `nvidia-smi --query-gpu=<_SMI_FIELDS> --format=csv,noheader,nounits` (memory in MiB)."""

    def mib(field: str) -> int | None:
        return int(float(field)) * 2**20 if re.fullmatch(r"[\d.]+", field) else None  # "[N/A]" on some boards

    gpus, driver = [], None
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if len(row) < 7:
            continue
        index, bus, uuid, name, total, free, driver = (field.strip() for field in row[:7])
        gpus.append(NvidiaGPU(int(index), _normal_bus_id(bus), uuid, name, mib(total), mib(free)))
    return NvidiaReport("nvidia-smi", driver, gpus)


def nvidia_gpus(run: Callable[..., Any] = subprocess.run) -> NvidiaReport | None:
    """The physical GPUs and the driver: from nvidia-smi, else NVML (pynvml / nvidia-ml-py), else None."""
    if shutil.which("nvidia-smi"):
        try:
            done = run(["nvidia-smi", f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=20)
            if done.returncode == 0:
                return parse_nvidia_smi(done.stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(NvidiaGPU(index, _normal_bus_id(text(pynvml.nvmlDeviceGetPciInfo(handle).busId)),
                                  text(pynvml.nvmlDeviceGetUUID(handle)), text(pynvml.nvmlDeviceGetName(handle)),
                                  int(memory.total), int(memory.free)))
        return NvidiaReport("nvml", text(pynvml.nvmlSystemGetDriverVersion()), gpus)
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()
