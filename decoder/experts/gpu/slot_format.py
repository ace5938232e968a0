"""The device slot cache's slot layout: what one slot holds and how big it is.

A slot holds one expert's quantized blocks as the file has them (the ``raw`` format, the only
one: a dequantized copy costs 2-7x the memory), in one preallocated uint8 tensor
``blobs [n_slots, slot_bytes]``, read in place by the fused kernels or dequantized on use::

      blobs[slot]:  +-- gate --+pad64+-- up --+pad64+-- down --+pad64+ ... +
                    ranges come from `SlotLayout` (one per layer), not from the daemon's arena
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ....common.layout import ExpertIndex, ExpertPart, round_up

_ALIGN = 64  # part alignment inside a device slot: any dtype view of a part stays aligned


@dataclass(frozen=True)
class SlotLayout:
    """Where an expert blob's parts live inside one device slot, for one layer."""

    parts: tuple[ExpertPart, ...]  # layer's parts (offsets are expert 0's; only qtype/shape matter)
    ranges: dict[str, tuple[int, int]]  # part name -> (offset in slot, nbytes)
    nbytes: int


def slot_layouts(index: ExpertIndex) -> list[SlotLayout]:
    """One compact layout per layer: parts back to back, each aligned to 64 bytes (an empty one
    for a dense layer, which has no experts)."""
    out = []
    for layer in range(index.n_layer):
        parts = tuple(index.parts(layer, 0)) if index.is_moe_layer(layer) else ()
        ranges, off = {}, 0
        for p in parts:
            ranges[p.name] = (off, p.nbytes)
            off = round_up(off + p.nbytes, _ALIGN)
        out.append(SlotLayout(parts, ranges, off))
    return out


def bytes_per_slot(index: ExpertIndex) -> int:
    """Device bytes one slot takes: the largest layer's expert blob, parts 64-byte aligned."""
    return max(lay.nbytes for lay in slot_layouts(index))


def slots_for_bytes(index: ExpertIndex, cache_bytes: int) -> int:
    """How many slots `cache_bytes` of device memory holds (`--cache-bytes`)."""
    per = bytes_per_slot(index)
    n = int(cache_bytes) // per
    if n < 1:
        raise ValueError(f"--cache-bytes {cache_bytes} is smaller than one slot ({per} bytes)")
    return n


def check_parts(key: Hashable, lay: SlotLayout, parts: Mapping[str, Any]) -> None:
    """Raise ValueError unless `parts` are exactly the layout's parts, each of its size."""
    if set(parts) != set(lay.ranges):
        raise ValueError(f"expert {key}: got parts {sorted(parts)}, expected {sorted(lay.ranges)}")
    for name, (_, n) in lay.ranges.items():
        got = memoryview(parts[name]).nbytes
        if got != n:
            raise ValueError(f"expert {key}: part {name!r} has {got} bytes, expected {n}")


def pack_parts(dst: np.ndarray, lay: SlotLayout, parts: Mapping[str, Any]) -> None:
    """Copy each part's bytes to its range in `dst` (a uint8 numpy view)."""
    for name, (off, n) in lay.ranges.items():
        dst[off:off + n] = np.frombuffer(parts[name], dtype=np.uint8, count=n)


def slot_kernels(layouts: list[SlotLayout], device: torch.device | str, want: bool | None = None,
                 act: str = "swiglu") -> Any:
    """The fused Triton kernels (`kernels.gpu.experts.SlotKernels`) for raw slots with these layouts,
    or None for today's path (dequantize each expert with torch, then matmuls).

    `want`: None picks them on CUDA when Triton is installed; True insists (on a CPU only under
    TRITON_INTERPRET=1, as the tests run them); False never. Layers whose quant types have no
    kernel keep today's path, said once per process. `act`: the family's expert activation."""
    dev = torch.device(device)
    if want is False or (want is None and dev.type != "cuda"):
        return None
    try:
        from ...kernels.gpu import experts as triton_experts
    except ImportError as e:
        if want:
            raise ValueError(f"the fused expert kernels need Triton ({e}); pip install triton") from None
        _notice("Triton is not installed: experts are dequantized with torch, then multiplied")
        return None
    if not triton_experts.available(dev):
        raise ValueError(f"the fused expert kernels run on CUDA (or on a CPU under TRITON_INTERPRET=1), not {dev}")
    from ...kernels.gpu.quant import has_kernel

    kernels = triton_experts.SlotKernels(layouts, dev, act)
    slow = [i for i in range(len(layouts)) if not kernels.supports(i)]
    if slow:
        why = sorted({f"{p.name} {p.qtype.name}" if has_kernel(p.qtype) else p.qtype.name
                      for i in slow for p in layouts[i].parts if not has_kernel(p.qtype) or "." in p.name})
        _notice(f"no fused kernel for {len(slow)} of {len(layouts)} expert layers ({', '.join(why)}): those "
                "layers are dequantized with torch, then multiplied")
    return kernels


_NOTICED: set[str] = set()


def _notice(msg: str) -> None:
    """A one-time notice per message and process, on stderr (a fallback is slower, not wrong)."""
    if msg not in _NOTICED:
        _NOTICED.add(msg)
        import sys

        print(f"moestream: {msg}", file=sys.stderr)
