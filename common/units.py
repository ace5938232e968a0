"""Sizes people type on command lines and in config files: "4GiB", "512M", "500MB", "1048576", "50%".

Bare k/m/g/t are binary (as in `ls -h` and most memory settings); kb/mb/gb/tb are decimal.
A percentage is of a total the caller names (e.g. physical memory for a memory budget).
"""

from __future__ import annotations

import math
import os
import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_BINARY = (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10))


def parse_size(text: str | int, *, percent_of: int | None = None) -> int:
    """'4GiB' -> 4294967296, '500MB' -> 500000000, '1.5k' -> 1536; ints pass through; '50%' is half of
    `percent_of` (only where the caller gives one). ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"bad size {text!r}: must be >= 0")
        return text
    pct = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", str(text))
    if pct and percent_of is not None:
        share = float(pct.group(1))
        if not 0 < share <= 100:
            raise ValueError(f"bad size {text!r}: a percentage must be in (0, 100]")
        return int(percent_of * share / 100)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        also = ", 50%" if percent_of is not None else ""
        raise ValueError(f"bad size {text!r} (examples: 4GiB, 512MiB, 500MB, 1048576{also})")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int, *, up: bool = False) -> str:
    """2.5GiB, 3.92MiB, 812B: at most two decimals in the largest binary unit; `up` rounds up, so the
    text, parsed back, is never less than `n` (for "give at least ..." messages)."""
    for unit, shift in _BINARY:
        if n >= 1 << shift:
            v = n / (1 << shift)
            text = f"{math.ceil(v * 100) / 100 if up else v:.2f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return f"{n}B"


def physical_memory() -> int:
    """This machine's physical memory in bytes (what `50%` of a memory budget refers to)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
