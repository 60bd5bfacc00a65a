"""The safetensors file format: read one tensor at a time, write a file tensor by tensor.

A safetensors file is

    +----------------+---------------------------+-------------------------------------------+
    | u64 LE: N      | N bytes of JSON header    | data: every tensor's bytes, back to back  |
    +----------------+---------------------------+-------------------------------------------+
    header = {"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}}

with offsets relative to the start of the data. We parse the header ourselves instead of mmapping the file:
`SafetensorsFile.read_into` reads a tensor's bytes straight into memory the caller owns (the final parameter,
or a small staging buffer), so a load never holds a second, page-cache-backed copy of the model in the
process's resident memory. `write_file` streams tensors to disk one at a time, so saving a model on a GPU
never gathers a full CPU copy either.

Offers: SafetensorsFile, TensorInfo, SafetensorsError, write_file, DTYPES, dtype_name.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Iterable, Mapping

import torch

# safetensors dtype string -> torch dtype (the names the safetensors library writes)
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
# dtypes that only recent torch builds have
for _name, _attr in [
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E8M0", "float8_e8m0fnu"),
]:
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# A header bigger than this is not a real checkpoint (the safetensors library uses the same 100 MB cap).
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_HAS_PREADV = hasattr(os, "preadv")


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, corrupt, or uses a dtype we cannot map to torch."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise SafetensorsError(
            f"dtype {dtype} cannot be stored in safetensors; supported: {', '.join(str(d) for d in _NAMES)}"
        ) from None


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a file: absolute byte offsets, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One safetensors file, opened for reading tensors by name (header parsed and checked on open).

    Use as a context manager, or call close(). `read_into` fills a caller-owned contiguous CPU tensor;
    `read` allocates one.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        # Unbuffered: readinto then reads straight into the destination memory, with no copy through a buffer.
        self._file = open(self.path, "rb", buffering=0)
        self._map: mmap.mmap | None = None
        try:
            self.metadata, self.tensors = self._parse_header()
        except BaseException:
            self._file.close()
            raise

    def _parse_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        file_size = os.fstat(self._file.fileno()).st_size
        if file_size < 8:
            raise SafetensorsError(
                f"{self.path} is truncated: it is {file_size} bytes, shorter than the 8-byte header length"
            )
        (header_len,) = struct.unpack("<Q", self._file.read(8))
        if header_len > file_size - 8:
            raise SafetensorsError(
                f"{self.path} is truncated or corrupt: its header length {header_len} is beyond the file size "
                f"{file_size} bytes; download or save the file again"
            )
        if header_len > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{self.path} is corrupt: its header length {header_len} is over 100 MB")
        raw = self._file.read(header_len)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SafetensorsError(f"{self.path} is corrupt: its header is not valid JSON ({err})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path} is corrupt: its header is a {type(header).__name__}, not an object")

        data_start = 8 + header_len
        data_size = file_size - data_start
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            tensors[name] = self._tensor_info(name, entry, data_start, data_size)
        return metadata, tensors

    def _tensor_info(self, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
        try:
            dtype_str, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(s) for s in shape)
            begin, end = int(begin), int(end)
        except (TypeError, KeyError, ValueError):
            raise SafetensorsError(
                f"{self.path} is corrupt: the header entry of tensor {name!r} is {entry!r}, "
                "expected {'dtype': str, 'shape': [int, ...], 'data_offsets': [begin, end]}"
            ) from None
        dtype = DTYPES.get(dtype_str)
        if dtype is None:
            raise SafetensorsError(
                f"tensor {name!r} in {self.path} has dtype {dtype_str!r}, which is not one of: "
                f"{', '.join(DTYPES)} (a newer format, or a torch build without that dtype)"
            )
        if end > data_size:
            raise SafetensorsError(
                f"{self.path} is truncated: tensor {name!r} ends at data byte {end} but the file holds only "
                f"{data_size} bytes of data; download or save the file again"
            )
        expected = prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != expected or min(shape, default=0) < 0:
            raise SafetensorsError(
                f"{self.path} is corrupt: tensor {name!r} ({dtype_str}, shape {list(shape)}) needs {expected} bytes "
                f"but its data_offsets [{begin}, {end}] span {end - begin}"
            )
        return TensorInfo(name, dtype, shape, data_start + begin, data_start + end)

    # reading

    def keys(self) -> list[str]:
        """Tensor names in the order their bytes sit in the file (the order they were written)."""
        return sorted(self.tensors, key=lambda n: self.tensors[n].start)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.path}") from None

    def read_bytes_into(self, start: int, out: memoryview) -> None:
        """Fill `out` with the file's bytes from absolute offset `start` (short reads are retried)."""
        done, total = 0, len(out)
        while done < total:
            if _HAS_PREADV:  # positional read: no shared file position, one syscall per chunk
                got = os.preadv(self._file.fileno(), [out[done:]], start + done)
            else:  # Windows
                self._file.seek(start + done)
                got = self._file.readinto(out[done:])
            if not got:
                raise SafetensorsError(
                    f"{self.path} is truncated: a read at byte {start + done} found the end of the file "
                    "(was it changed while loading?)"
                )
            done += got

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read tensor `name` into `out`: a contiguous CPU tensor of its dtype and number of elements."""
        info = self.info(name)
        if out.dtype != info.dtype or out.numel() != prod(info.shape) or not out.is_contiguous() or out.is_cuda:
            raise ValueError(
                f"read_into({name!r}) needs a contiguous CPU tensor of {info.dtype} with {prod(info.shape)} "
                f"elements, got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        self.read_bytes_into(info.start, byte_view(out))

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` as a new CPU tensor of its stored dtype and shape."""
        info = self.info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(name, out)
        return out

    def mapped(self, name: str) -> torch.Tensor | None:
        """Tensor `name` as a copy-on-write view of the file's pages (no read now; pages come in on first touch
        and writes stay private to this process), or None when its bytes are not aligned for its dtype."""
        info = self.info(name)
        if info.start % info.dtype.itemsize or not prod(info.shape):
            return None
        if self._map is None:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=info.dtype, count=prod(info.shape), offset=info.start)
        return flat.view(info.shape)

    def close(self) -> None:
        # An mmap outlives the file descriptor; tensors made by mapped() keep it alive.
        self._file.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (for readinto / write)."""
    flat = tensor.reshape(-1)  # 0-d tensors cannot change dtype by view; (n,) can
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_file(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write `tensors` (on any device) to a safetensors file at `path`, one tensor at a time; return bytes written.

    Tensors are laid out by decreasing element size then name, as the safetensors library does, so each one
    starts at an offset aligned to its element size. The file is written in place: callers that need
    atomicity write to a temporary name and rename (save.py does).
    """
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    items.sort(key=lambda kv: (-kv[1].dtype.itemsize, kv[0]))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, tensor in items:
        if tensor.device.type == "meta":
            raise ValueError(f"cannot save tensor {name!r}: it is on the meta device (its weights were never loaded)")
        nbytes = tensor.numel() * tensor.dtype.itemsize
        header[name] = {
            "dtype": dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # pad so that the data starts 8-byte aligned

    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, tensor in items:
            if tensor.numel():
                # One tensor at a time on the CPU: a GPU model is never copied to the host in full.
                f.write(byte_view(tensor.detach().to("cpu").contiguous()))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset
