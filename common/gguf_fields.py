"""GGUF metadata arrays kept as a few offsets, not one numpy view per element.

gguf-py's reader turns every element of a metadata array into its own numpy view (a string is
two: its length and its bytes). A 151,936-token vocabulary (Qwen3's; DeepSeek-V3's is 129,280)
with its token types and ~151,000 merges is ~760,000 views: 466 MiB (tracemalloc) that
both processes held for as long as the model was open, more than all the rest of a decoder on a
small model. Here an array of numbers is one view of the file's map, and an array of strings is
the start and length of each string (16 bytes each); `contents()` decodes them when asked, as
gguf-py's `ReaderField.contents()` does (the same Python values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField


@dataclass(frozen=True, eq=False)
class ArrayField:
    """One metadata array (`ReaderField`'s `offset`, `name`, `types`, `contents()`)."""

    offset: int
    name: str
    types: list[GGUFValueType]
    data: np.ndarray = field(repr=False)  # the file's map (strings) or the array's elements (numbers)
    starts: np.ndarray | None = field(default=None, repr=False)  # [n] int64: strings' first bytes
    lengths: np.ndarray | None = field(default=None, repr=False)  # [n] int64

    def __len__(self) -> int:
        return len(self.data) if self.starts is None else len(self.starts)

    def contents(self) -> list[Any]:
        if self.starts is None:
            return self.data.tolist()
        data = self.data
        return [str(data[s:s + n].tobytes(), encoding="utf-8")
                for s, n in zip(self.starts.tolist(), self.lengths.tolist())]


class CompactReader(GGUFReader):
    """gguf-py's reader with its metadata arrays as ArrayField (arrays of arrays, which no model
    key uses, and scalars stay gguf-py's ReaderField)."""

    def _build_fields(self, offs: int, count: int) -> int:
        return _build_fields(self, offs, count)


def _build_fields(reader: GGUFReader, offs: int, count: int) -> int:
    """GGUFReader._build_fields, its arrays read by _array. Returns the offset after them."""
    for _ in range(count):
        orig = offs
        klen, kdata = reader._get_str(offs)
        offs += int(klen.nbytes + kdata.nbytes)
        raw_type = reader._get(offs, np.uint32)
        offs += int(raw_type.nbytes)
        name = str(bytes(kdata), encoding="utf-8")
        compact = _array(reader, orig, name, offs) if raw_type[0] == GGUFValueType.ARRAY else None
        if compact is not None:
            f, offs = compact
        else:
            size, parts, idxs, types = reader._get_field_parts(offs, raw_type[0])
            f = ReaderField(orig, name, [klen, kdata, raw_type, *parts], [i + 3 for i in idxs], types)
            offs += size
        reader._push_field(f, skip_sum=True)
    return offs


def _array(reader: GGUFReader, orig: int, name: str, offs: int) -> tuple[ArrayField, int] | None:
    """(the array at offs as an ArrayField, the offset after it), or None for arrays of arrays."""
    sub = GGUFValueType(int(reader._get(offs, np.uint32)[0]))
    n = int(reader._get(offs + 4, np.uint64)[0])
    offs += 12
    types = [GGUFValueType.ARRAY, sub]
    nptype = reader.gguf_scalar_to_np.get(sub)
    if nptype is not None:
        values = reader._get(offs, nptype, n)
        if len(values) != n:
            raise ValueError(f"metadata array {name!r} runs past the end of the file")
        return ArrayField(orig, name, types, values), offs + int(values.nbytes)
    if sub != GGUFValueType.STRING:
        return None
    raw, end = memoryview(reader.data), len(reader.data)
    if n > (end - offs) // 8:  # (a string takes 8 bytes at least: no allocation for a bogus count)
        raise ValueError(f"metadata array {name!r} of {n} strings runs past the end of the file")
    starts, lengths = np.empty(n, np.int64), np.empty(n, np.int64)
    order = "big" if reader.byte_order == "S" else "little"
    for i in range(n):  # each length says where the next string starts
        if offs + 8 > end:
            raise ValueError(f"metadata array {name!r} runs past the end of the file")
        length = int.from_bytes(raw[offs:offs + 8], order)
        starts[i], lengths[i] = offs + 8, length
        offs += 8 + length
    if offs > end:
        raise ValueError(f"metadata array {name!r} runs past the end of the file")
    return ArrayField(orig, name, types, reader.data, starts, lengths), offs
