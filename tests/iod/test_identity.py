"""The model's identity is its content (issue 12, item 9): a byte-identical copy or a `touch`ed
file is the same model; a file with the same header and size but other expert bytes is not,
and the decoder is told what differs. Checked through real daemons and the `generate` command."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader

from moestream.common.client import FingerprintMismatch, IodClient
from moestream.common.layout import SAMPLE_CHUNK_BYTES, SAMPLE_CHUNKS, ModelLayout, sample_ranges
from moestream.decoder import cli


def test_sample_covers_small_data_whole_and_large_data_in_spread_chunks():
    assert sample_ranges(100, 100 + 5000) == [(100, 5100)]
    assert sample_ranges(7, 7) == []
    start, end = 4096, 4096 + 370 * 2**30  # a 370 GiB model: 4 MiB read, first and last bytes included
    r = sample_ranges(start, end)
    assert len(r) == SAMPLE_CHUNKS and r[0][0] == start and r[-1][1] == end
    assert all(hi - lo == SAMPLE_CHUNK_BYTES for lo, hi in r)
    assert all(a[1] <= b[0] for a, b in zip(r, r[1:]))  # sorted, no overlap
    gaps = [b[0] - a[0] for a, b in zip(r, r[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spread


def test_fingerprint_of_a_small_model_hashes_all_its_data(tiny_model):
    raw = tiny_model.read_bytes()
    data_offset = GGUFReader(tiny_model).data_offset  # independent of our reader
    fp = ModelLayout(tiny_model).fingerprint
    assert fp.header_sha256 == hashlib.sha256(raw[:data_offset]).hexdigest()
    assert fp.sample_sha256 == hashlib.sha256(raw[data_offset:]).hexdigest()
    assert fp.sample_bytes == len(raw) - data_offset


def patched_copy(src: Path, dst: Path) -> Path:
    """`src` with one byte of expert (1, 3)'s down part changed: same header, same size."""
    shutil.copyfile(src, dst)
    part = [p for p in ModelLayout(src).experts.parts(1, 3) if p.name == "down"][0]
    with open(dst, "r+b") as f:
        f.seek(part.offset + part.nbytes // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))
    return dst


def test_copy_and_touched_file_are_the_same_model(tiny_model, start_daemon, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_model, copy)
    os.utime(copy, ns=(1, 1))  # another path, another mtime: the same bytes
    d = start_daemon(copy, arena_slots=4)
    expect = ModelLayout(tiny_model).fingerprint.as_dict()
    with IodClient(d.endpoint, expect_fingerprint=expect) as c:
        assert c.welcome["fingerprint"]["path"] == str(copy.resolve())
        c.release(c.fetch([(0, 0)])[0].result(10))
    os.utime(copy, ns=(2, 2))  # touched after the daemon opened it: the decoder sees the new mtime
    with IodClient(d.endpoint, expect_fingerprint=ModelLayout(copy).fingerprint.as_dict()) as c:
        c.ping()


def test_same_header_and_size_other_weights_is_refused(tiny_model, start_daemon, tmp_path, capsys):
    patched = patched_copy(tiny_model, tmp_path / "patched.gguf")
    assert patched.stat().st_size == tiny_model.stat().st_size
    d = start_daemon(patched, arena_slots=4)
    with pytest.raises(FingerprintMismatch) as e:
        IodClient(d.endpoint, expect_fingerprint=ModelLayout(tiny_model).fingerprint.as_dict())
    msg = str(e.value)
    assert "tensor data sample differs" in msg and "other weights" in msg and str(patched.resolve()) in msg
    assert "header/tensor table differs" not in msg and "file size differs" not in msg
    # the decoder command says the same, in one line
    assert cli.main(["--model", str(tiny_model), "--iod", d.endpoint, "--prompt-ids", "1,2,3", "-n", "2",
                     "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moestream generate: ") and "tensor data sample differs" in err[0]
