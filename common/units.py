"""Sizes people type on command lines and in config files: "4GiB", "512M", "500MB", "1048576".

Bare k/m/g/t are binary (as in `ls -h` and most memory settings); kb/mb/gb/tb are decimal.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str | int) -> int:
    """'4GiB' -> 4294967296, '500MB' -> 500000000, '1.5k' -> 1536; ints pass through. ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"bad size {text!r}: must be >= 0")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r} (examples: 4GiB, 512MiB, 500MB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
