"""Slot storage formats of the device slot cache: what one slot holds and how big it is.

Two slot formats (`DecoderConfig.slot_format`):

- ``raw``: one preallocated uint8 tensor ``blobs [n_slots, slot_bytes]`` holding quantized
  blobs, dequantized on every use. More experts fit; the default on CUDA, where
  dequantize-on-use kernels are cheap::

      blobs[slot]:  +-- gate --+pad64+-- up --+pad64+-- down --+pad64+ ... +
                    ranges come from `SlotLayout` (one per layer), not from the daemon's arena

- ``dequant``: preallocated float tensors ``gate/up [n_slots, ff, d]`` and
  ``down [n_slots, d, ff]``, filled once on insert. The default on CPU, where dequantizing on
  every use would cost more than the matmuls.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...common.layout import ExpertIndex, ExpertPart, round_up

SLOT_FORMATS = ("raw", "dequant")
_ALIGN = 64  # part alignment inside a device slot: any dtype view of a part stays aligned


def default_slot_format(device: torch.device | str) -> str:
    """raw on CUDA (dequantize-on-use is cheap there), dequant elsewhere."""
    return "raw" if torch.device(device).type == "cuda" else "dequant"


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


def dequant_shapes(layouts: list[SlotLayout]) -> dict[str, tuple[int, int]]:
    """Torch shapes of gate/up/down for the dequant format; every layer must agree."""
    shapes = None
    for layer, lay in enumerate(layouts):
        if not lay.parts:
            continue  # a dense layer: no experts
        mats = {p.name: tuple(reversed(p.shape)) for p in lay.parts}  # [n_out, n_in]
        if "gate_up" in mats:
            two_ff, d = mats.pop("gate_up")
            mats["gate"] = mats["up"] = (two_ff // 2, d)
        if set(mats) != {"gate", "up", "down"}:
            raise ValueError(f"dequant slots support gate/up/down experts only; layer {layer} has {sorted(mats)}")
        if shapes is not None and mats != shapes:
            raise ValueError(f"dequant slots need one expert shape for all layers: layer {layer} has {mats}, "
                             f"layer 0 has {shapes}; use slot_format='raw'")
        shapes = mats
    assert shapes is not None
    return shapes


def bytes_per_slot(index: ExpertIndex, slot_format: str, dtype: torch.dtype = torch.float32) -> int:
    """Device bytes one slot takes in `slot_format`."""
    layouts = slot_layouts(index)
    if slot_format == "raw":
        return max(lay.nbytes for lay in layouts)
    if slot_format == "dequant":
        return sum(a * b for a, b in dequant_shapes(layouts).values()) * dtype.itemsize
    raise ValueError(f"slot_format must be one of {SLOT_FORMATS}, got {slot_format!r}")


def slots_for_bytes(index: ExpertIndex, cache_bytes: int, slot_format: str,
                    dtype: torch.dtype = torch.float32) -> int:
    """How many slots `cache_bytes` of device memory holds (`--cache-bytes`)."""
    per = bytes_per_slot(index, slot_format, dtype)
    n = int(cache_bytes) // per
    if n < 1:
        raise ValueError(f"--cache-bytes {cache_bytes} is smaller than one {slot_format} slot ({per} bytes)")
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


def slot_kernels(layouts: list[SlotLayout], device: torch.device | str, want: bool | None = None) -> Any:
    """The fused Triton kernels (`triton_experts.SlotKernels`) for raw slots with these layouts,
    or None for today's path (dequantize each expert with torch, then matmuls).

    `want`: None picks them on CUDA when Triton is installed; True insists (on a CPU only under
    TRITON_INTERPRET=1, as the tests run them); False never. Layers whose quant types have no
    kernel keep today's path, said once per process."""
    dev = torch.device(device)
    if want is False or (want is None and dev.type != "cuda"):
        return None
    try:
        from ..kernels import triton_experts
    except ImportError as e:
        if want:
            raise ValueError(f"the fused expert kernels need Triton ({e}); pip install triton") from None
        _notice("Triton is not installed: experts are dequantized with torch, then multiplied")
        return None
    if not triton_experts.available(dev):
        raise ValueError(f"the fused expert kernels run on CUDA (or on a CPU under TRITON_INTERPRET=1), not {dev}")
    from ..kernels.triton_quant import has_kernel

    kernels = triton_experts.SlotKernels(layouts, dev)
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
