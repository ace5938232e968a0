"""The decoder's own memory and file reads (decoder/footprint.py), checked against the kernel's view
of the process (/proc/self/smaps), not against our own bookkeeping."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import moestream
from moestream.common.layout import ModelLayout
from moestream.decoder.footprint import advise_random
from moestream.decoder.models.weights import load_quantized

MODEL = Path(moestream.__file__).parent / "data" / "tiny-qwen3moe-q8_0.gguf"


def vm_flags(addr: int) -> list[str]:
    """The kernel's flags of the mapping holding `addr` (smaps' VmFlags; "rr": MADV_RANDOM)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_a_table_read_by_rows_is_mapped_without_read_around(tmp_path):
    path = tmp_path / "table.bin"
    path.write_bytes(bytes(64 << 10))
    whole = np.memmap(path, np.uint8, mode="r")
    rows = whole[5000:40000]  # not page-aligned: the pages under it are advised
    assert "rr" not in vm_flags(rows.ctypes.data)
    assert advise_random(rows)
    assert "rr" in vm_flags(rows.ctypes.data)


def test_a_mapped_embedding_table_is_advised_and_a_copied_one_is_not():
    layout = ModelLayout(MODEL)
    mapped = load_quantized(layout, "token_embd.weight", mapped=True)
    assert "rr" in vm_flags(mapped.m.addr)
    copied = load_quantized(layout, "blk.0.attn_q.weight")
    assert "rr" not in vm_flags(copied.m.addr)  # its own (anonymous) memory
