"""Byte sizes: read from what users write (1234, "5GB", "2GiB") and written for people ("1.50 GiB", "12.0 MiB").

Offers: parse_size, format_size.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(size: int | float | str, name: str = "size", allow_zero: bool = False) -> int:
    """Bytes in `size`: a number of bytes, or a string such as "5GB" (10^9), "500MB", "2GiB" (2^30). `name` is
    what the error calls the value (e.g. "max_memory['cpu']")."""
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        value = int(size)
    else:
        match = _SIZE.fullmatch(str(size))
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"{name} = {size!r} is not a size: pass an int of bytes or a string like '5GB', '500MB' "
                             "or '2GiB'")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} = {size!r} must be {'at least 0' if allow_zero else 'more than 0'} bytes")
    return value


def format_size(num_bytes: int | None) -> str:
    """GiB with two decimals from 1 GiB up, MiB below; "?" for an unknown size."""
    if num_bytes is None:
        return "?"
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
