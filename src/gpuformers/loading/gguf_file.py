"""GGUFFile: a GGUF file's metadata and tensor table, read in one pass over its header.

The `gguf` package's GGUFReader builds a memory-mapped view for every part of every metadata value, which takes
seconds for a vocabulary (~2 s for SmolLM2's 49k tokens and 48k merges); this reads the same header with `struct`
and `numpy.frombuffer` in tens of milliseconds. The format (llama.cpp's gguf.md, versions 2 and 3, little-endian):

    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata: key (string), value type u32, value      string: length u64 + UTF-8 bytes
                                                        array: item type u32, count u64, items
    tensor infos: name (string), dimension count u32, dimensions u64 each (fastest first), ggml type u32,
                  offset u64 (from the start of the data section)
    padding to `general.alignment` (32 when absent), then the tensor data

`metadata` maps each key to a Python value (str, int, float, bool, or a list of them; a float32 becomes the
shortest decimal that rounds to it, 1e-05 rather than 9.999999747378752e-06). `tensors` lists GGUFTensor entries
whose `data` is a read-only view of the memory-mapped file in the layout GGUFReader gives (the element type for
float and integer tensors, reversed dimensions; uint8 blocks per row for quantized ones), so gguf.quants dequantizes
it as before. Big-endian files (s390x builds of llama.cpp) are refused by name.

Offers: GGUFFile, GGUFTensor.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# GGUF value types (gguf.GGUFValueType): scalar type -> (struct format, numpy dtype)
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY, _FLOAT32, _BOOL = 8, 9, 6, 7
_DEFAULT_ALIGNMENT = 32
_FIRST_READ = 8 << 20  # bytes of the file read for its header at first (SmolLM2's is 2 MiB), four times more if short
# ggml types whose data is an array of that element type (the others are quantized blocks, read as uint8)
_ELEMENT_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                  28: np.float64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dimensions, fastest first, as in the file (uint64)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _NeedMore(Exception):
    """The header goes on past the bytes read so far."""


class _Cursor:
    """Reads little-endian values from the header bytes, advancing."""

    __slots__ = ("buf", "pos", "path", "whole")

    def __init__(self, buf: bytes, path: Path, whole: bool):
        self.buf, self.pos, self.path, self.whole = buf, 0, path, whole  # whole: buf is the entire file

    def need(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            if not self.whole:
                raise _NeedMore
            raise ValueError(f"GGUF file {str(self.path)!r} is truncated: its header ends at byte {len(self.buf)}, "
                             f"inside a value at byte {self.pos}; download it again")

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.need(length)
        text = self.buf[self.pos:self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            fmt, dtype = self._scalar_type(item)
            size = np.dtype(dtype).itemsize * count
            self.need(size)
            values = np.frombuffer(self.buf, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=self.pos)
            self.pos += size
            return values.tolist()
        fmt, _ = self._scalar_type(kind)
        value = self.scalar(fmt)
        if kind == _FLOAT32:
            return float(str(np.float32(value)))  # the shortest decimal that rounds to this float32
        return bool(value) if kind == _BOOL else value

    def _scalar_type(self, kind: int):
        if kind not in _SCALARS:
            raise ValueError(f"GGUF file {str(self.path)!r} has a metadata value of unknown type {kind} at byte "
                             f"{self.pos}: not a GGUF version this reader knows; the file may be damaged")
        return _SCALARS[kind]


class GGUFFile:
    """A GGUF file's `version`, `metadata` (key -> Python value) and `tensors` (GGUFTensor, in file order)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")  # uint8, read-only
        bound = _FIRST_READ  # the header (metadata and tensor table) is in the first bytes; more are read if not
        while True:
            whole = bound >= len(self._map)
            try:
                self._parse(_Cursor(bytes(self._map[:bound]), self.path, whole))
                return
            except _NeedMore:
                bound *= 4

    def release(self, view: np.ndarray) -> None:
        """Drop from this process's memory the file pages that `view` (a slice of a tensor's data) lies on, once
        they are read: the mapped file otherwise stays resident until the load ends and adds its whole size to the
        peak (94 MiB for the embedded SmolLM2 file). Reading them again maps them again from the file; only pages
        wholly inside `view` are dropped, so a neighbour's pages stay."""
        if not view.size or not hasattr(mmap, "MADV_DONTNEED"):
            return
        base = self._map.ctypes.data
        start, end = view.ctypes.data - base, view.ctypes.data - base + view.nbytes
        if not (view.flags.c_contiguous and 0 <= start < end <= len(self._map)):
            return
        first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._map._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _parse(self, cursor: _Cursor) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        magic = bytes(cursor.buf[:4])
        if magic != b"GGUF":
            raise ValueError(f"{str(self.path)!r} is not a GGUF file: it starts with {magic!r} instead of b'GGUF'")
        cursor.pos = 4
        self.version = cursor.scalar("<I")
        if self.version not in (2, 3):
            swapped = struct.unpack("<I", struct.pack(">I", self.version))[0]
            if swapped in (2, 3):
                raise ValueError(f"GGUF file {str(self.path)!r} is big-endian (written for s390x); convert it with "
                                 f"llama.cpp's gguf tools for a little-endian machine")
            raise ValueError(f"GGUF file {str(self.path)!r} is version {self.version}; versions 2 and 3 are read")
        n_tensors, n_metadata = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_metadata):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            infos.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"GGUF file {str(self.path)!r} has two tensors named {name!r}")
            seen.add(name)
            try:
                ggml_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} of {str(self.path)!r} has ggml type {raw_type}, which the installed "
                                 f"gguf package does not know; upgrade it (pip install -U gguf)") from None
            n_elements = int(np.prod(dims)) if dims else 1
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elements * type_size // block_size
            start = data_start + offset
            if start + n_bytes > len(self._map):
                raise ValueError(f"GGUF file {str(self.path)!r} is truncated: tensor {name!r} ends at byte "
                                 f"{start + n_bytes} of {len(self._map)}; download it again")
            shape = tuple(reversed(dims))
            if raw_type in _ELEMENT_TYPES:
                data = self._map[start:start + n_bytes].view(_ELEMENT_TYPES[raw_type]).reshape(shape)
            else:
                data = self._map[start:start + n_bytes].reshape(quant_shape_to_byte_shape(shape, ggml_type))
            self.tensors.append(GGUFTensor(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes,
                                           start, data))
