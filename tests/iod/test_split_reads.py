"""A split model through the daemon: one descriptor per part, reads batched across parts (never
coalesced across files), every expert's bytes as the part files hold them, a bad part refused."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checker import check_all
from moestream.authoring.make_model import make_model
from moestream.common.layout import PAGE, ModelLayout
from moestream.iod.readers import ReadOp, open_reader
from moestream.tools.status import get_status
from test_readers import BACKENDS, Waiter

MODEL = dict(arch="qwen3moe", quant="Q8_0", layers=2, experts=8, seed=5)


@pytest.fixture(scope="module")
def split_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("split-iod")
    return make_model(root / "m.gguf", split_max_size=40_000, **MODEL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_submit_reads_from_several_files(tmp_path: Path, backend: str) -> None:
    """Ranges that touch by offset but lie in different files are two reads, each from its file."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(os.urandom(3 * PAGE))
    b.write_bytes(os.urandom(3 * PAGE))
    buf = mmap.mmap(-1, 4 * PAGE)
    view = memoryview(buf)
    ops = [ReadOp(0, PAGE, view[:PAGE], file=0), ReadOp(PAGE, PAGE, view[PAGE:2 * PAGE], file=0),
           ReadOp(2 * PAGE, PAGE, view[2 * PAGE:3 * PAGE], file=1),  # starts where a's run ends, in b
           ReadOp(0, PAGE, view[3 * PAGE:], file=1)]
    with open_reader([a, b], backend=backend, depth=1) as r:
        done = Waiter(1)
        r.submit(ops, done)
        assert done.wait() == []
        st = r.stats()
        with pytest.raises(ValueError, match="file index 2"):
            r.submit([ReadOp(0, PAGE, view[:PAGE], file=2)], done)
    del view, ops
    want = a.read_bytes()[:2 * PAGE] + b.read_bytes()[2 * PAGE:] + b.read_bytes()[:PAGE]
    assert bytes(buf) == want
    assert st["bytes"] == 4 * PAGE and st["ops"] == 4
    assert st["preadv_calls"] == 3  # a[0:2P] coalesced; b[2P:3P] and b[0:P] do not touch
    buf.close()


@pytest.mark.parametrize("extra", [[], ["--direct"], ["--backend", "threads"]])
def test_daemon_serves_a_split_models_bytes(split_model, start_daemon, extra):
    lay = ModelLayout(split_model)
    assert len(lay.files) >= 5 and any(len({p.file for p in lay.experts.parts(0, e)}) > 1 for e in range(8))
    d = start_daemon(split_model, arena_slots=4, extra_args=extra)
    got = check_all(d.endpoint, str(split_model))  # compares with each part file's own bytes
    assert got["checked"] == lay.experts.n_blobs and got["served"] == lay.experts.total_bytes
    s = get_status(d.status_endpoint)
    assert s["reader"]["errors"] == 0 and s["reader"]["bytes"] >= lay.experts.total_bytes
    assert s["fingerprint"] == lay.fingerprint.as_dict()
    assert f"serving {split_model.name} and {len(lay.files) - 1} more parts" in d.log_text()


def test_daemon_refuses_a_missing_part_in_one_line(split_model, tmp_path):
    parts = sorted(split_model.parent.glob("m-*-of-*.gguf"))
    (tmp_path / "m").mkdir()
    copies = [Path(shutil.copy(p, tmp_path / "m" / p.name)) for p in parts]
    copies[2].write_bytes(copies[2].read_bytes()[:-3000])  # truncated
    out = subprocess.run([sys.executable, "-m", "moestream.iod.main", "--model", str(copies[-1]),
                          "--endpoint", f"ipc://{tmp_path}/a.sock", "--status-endpoint", f"ipc://{tmp_path}/s.sock"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr  # a configuration error: systemd does not retry
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"moestream-iod: error: {copies[2].name}: truncated: tensor"), line
    assert not (tmp_path / "a.sock").exists() and not (tmp_path / "s.sock").exists()
