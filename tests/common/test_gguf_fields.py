"""Compact metadata arrays (common.gguf_fields) against gguf-py's own reader, in memory and on bad files."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from moestream.common.gguf_fields import ArrayField, CompactReader
from moestream.common.layout import ModelFormatError, ModelLayout

VOCAB = 151_936  # Qwen3's


def _write(path: Path, n_strings: int = 300) -> Path:
    """A GGUF with every kind of metadata: scalars, a string, arrays of each number type, of
    strings (some empty, some not ASCII), of bools, and an array of arrays."""
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 0.5)
    w.add_string("test.str", "héllo")
    w.add_array("test.strings", [f"tok{i}" if i % 7 else ("" if i % 2 else "Ġ€ ▁x") for i in range(n_strings)])
    w.add_array("test.ints", list(range(-50, 50)))
    w.add_array("test.floats", [i / 3 for i in range(40)])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.empty", [])
    w.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    w.add_tensor("t", np.arange(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_read_as_gguf_py_reads_them(tmp_path):
    path = _write(tmp_path / "m.gguf")
    stock, mine = GGUFReader(path), CompactReader(path)
    assert list(mine.fields) == list(stock.fields)
    for key, f in stock.fields.items():
        assert mine.fields[key].contents() == f.contents(), key
        assert mine.fields[key].types == f.types, key
    assert isinstance(mine.fields["test.strings"], ArrayField) and isinstance(mine.fields["test.ints"], ArrayField)
    assert mine.data_offset == stock.data_offset
    assert [t.name for t in mine.tensors] == [t.name for t in stock.tensors]


def test_a_real_vocabulary_takes_megabytes_not_hundreds(tmp_path):
    """A vocabulary of Qwen3's size (tokens, types and as many merges): gguf-py's reader made
    ~760,000 numpy views of it (466 MiB traced); compact, a few MB in all."""
    w = GGUFWriter(str(tmp_path / "v.gguf"), "qwen3moe")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [1] * VOCAB)
    w.add_array("tokenizer.ggml.merges", [f"a{i} b{i}" for i in range(VOCAB)])
    w.add_tensor("t", np.zeros(16, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    tracemalloc.start()
    try:
        reader = CompactReader(tmp_path / "v.gguf")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB"
    assert reader.fields["tokenizer.ggml.tokens"].contents()[VOCAB - 1] == f"t{VOCAB - 1}"
    assert reader.fields["tokenizer.ggml.merges"].contents()[:2] == ["a0 b0", "a1 b1"]


def _string_array_offset(path: Path, key: str) -> int:
    """The offset of `key`'s array count (after its element type) in the file."""
    f = GGUFReader(path).fields[key]
    return f.offset + 8 + len(key) + 4 + 4


@pytest.mark.parametrize("where", ["early", "in its last string"])
def test_a_file_cut_inside_an_array_is_named(tiny_model, tmp_path, where):
    data = tiny_model.read_bytes()
    fields = list(GGUFReader(tiny_model).fields.values())
    after = fields[[f.name for f in fields].index("tokenizer.ggml.tokens") + 1].offset  # the next key's start
    cut = _string_array_offset(tiny_model, "tokenizer.ggml.tokens") + 100 if where == "early" else after - 2
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ModelFormatError, match="'tokenizer.ggml.tokens'.*runs past the end of the file"):
        ModelLayout(bad)


def test_a_bogus_array_count_is_an_error_not_an_allocation(tiny_model, tmp_path):
    data = bytearray(tiny_model.read_bytes())
    at = _string_array_offset(tiny_model, "tokenizer.ggml.tokens")
    data[at:at + 8] = (2**62).to_bytes(8, "little")
    bad = tmp_path / "count.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=f"of {2**62} strings runs past the end"):
        ModelLayout(bad)
