"""numba's kernel cache where the install is read-only and the home is not writable, and no
compilation in the first request (the kernels are compiled, or loaded, while the model loads)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from moestream.decoder import numba_setup as ns

UNWRITABLE = Path("/proc/moestream-no-such-dir")  # not even root can make a directory here


def test_numba_keeps_its_own_choice_where_it_can_write(tmp_path):
    assert ns.choose_cache_dir({"NUMBA_CACHE_DIR": "/x"}, UNWRITABLE) is None  # the user's choice stands
    assert ns.choose_cache_dir({}, tmp_path) is None  # a writable install: numba's __pycache__


def test_a_read_only_install_caches_in_the_first_writable_place(tmp_path):
    env = {"CACHE_DIRECTORY": str(tmp_path / "svc"), "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": "/proc",
           "TMPDIR": str(tmp_path / "tmp")}
    assert ns.choose_cache_dir(env, UNWRITABLE) == tmp_path / "svc" / "numba"  # systemd's CacheDirectory=
    del env["CACHE_DIRECTORY"]
    assert ns.choose_cache_dir(env, UNWRITABLE) == tmp_path / "xdg" / "moestream" / "numba"
    del env["XDG_CACHE_HOME"]  # HOME=/proc: no writable home either
    assert ns.choose_cache_dir(env, UNWRITABLE) == tmp_path / "tmp" / f"moestream-numba-{os.getuid()}"
    assert ns.kernels_cached(tmp_path / "tmp") is False


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and mount namespaces (unshare -m)")
def test_the_kernels_load_from_a_read_only_install_without_a_home(tmp_path):
    """The kernels' folder bind-mounted read-only, HOME unwritable: numba alone refuses to define
    the kernels ("no locator available"); the decoder points it at a writable cache."""
    kernels = ns.KERNELS_DIR
    probe = ("import os; from moestream.decoder.kernels.cpu import rows as cpu_rows; "
             "print(os.environ['NUMBA_CACHE_DIR']); print(cpu_rows.row_bytes._cache._cache_path)")
    script = textwrap.dedent(f"""
        mount --bind {kernels} {kernels} && mount -o remount,bind,ro {kernels} || exit 99
        env -u NUMBA_CACHE_DIR -u XDG_CACHE_HOME HOME=/proc TMPDIR={tmp_path} {sys.executable} -c "{probe}"
    """)
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                       text=True, timeout=120)
    if r.returncode == 99:
        pytest.skip("cannot bind-mount read-only here")
    assert r.returncode == 0, r.stderr[-2000:]
    cache_dir, fn_cache = r.stdout.split()
    assert cache_dir == str(tmp_path / f"moestream-numba-{os.getuid()}")
    assert fn_cache.startswith(cache_dir)  # numba's own locator put that kernel's cache there


FIRST_REQUEST = """
import contextlib, io, json, sys
from moestream.decoder import cli

def signatures():
    return {f"{m}.{n}": len(f.signatures) for m, mod in list(sys.modules.items())
            if m.startswith("moestream.decoder.kernels") for n, f in vars(mod).items()
            if hasattr(f, "signatures") and hasattr(f, "py_func")}

argv = ["--model", sys.argv[1], *sys.argv[2:], "--json", "--no-progress", "--threads", "1", "--prompt-ids",
        "5,6,7,8,9,10,11,12", "-n", "4"]
# what `generate` does while loading the model, then the request: no kernel may compile during it
cli.warm_cpu_kernels(cli.config_from_args(cli.build_parser().parse_args(argv)))
before = signatures()
with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(argv) == 0
after = signatures()
print(json.dumps({"kernels": len(after), "new": {k: after[k] - before.get(k, 0) for k in after
                                                if after[k] != before.get(k, 0)}}))
"""


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_the_first_request_compiles_nothing(tiny_model, start_daemon, streamed):
    """Resident, and streamed from an arena too small for a layer's experts (hits, misses and
    arrival batches each take their own compiled steps)."""
    where = ["--iod", start_daemon(tiny_model, arena_slots=4).endpoint] if streamed else ["--resident"]
    r = subprocess.run([sys.executable, "-c", FIRST_REQUEST, str(tiny_model), *where], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kernels"] > 0 and out["new"] == {}, out


def test_the_first_run_says_it_compiles_and_where_it_caches(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(ns, "cache_location", lambda: tmp_path)
    monkeypatch.setattr(ns, "_run_once", lambda: None)  # (the compile itself is the test above)
    ns.warm_kernels(said.append)
    assert len(said) == 1 and "compiling the CPU kernels" in said[0] and str(tmp_path) in said[0]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rows.gate_up_kernel-401.py311.nbi").write_bytes(b"")
    ns.warm_kernels(said.append)
    assert len(said) == 1  # a cache there: nothing to say


_LINK_AFTER_LOAD = textwrap.dedent("""
    import numpy as np
    from numba import njit
    from moestream.decoder.kernels.cpu import moe

    ys = np.ones((3, 4), np.float32)
    moe.weigh(ys, np.array([2.0, 3.0, 4.0], np.float32), np.array([2, 0, 1]))  # loaded (or compiled)
    lib = next(iter(moe.weigh.overloads.values())).library
    held = lib._shared_module is not None

    @njit
    def twice(ys, w, picks):  # a new compile that links the loaded kernel's module
        moe.weigh(ys, w, picks)
        moe.weigh(ys, w, picks)

    twice(ys, np.array([2.0, 3.0, 4.0], np.float32), np.array([2, 0, 1]))
    print(held, ys[:, 0].tolist())
""")


def test_a_cached_kernel_links_into_a_new_compile(tmp_path):
    """A kernel loaded from numba's cache keeps its link module as bitcode only
    (jit_cache.lazy_link_modules) and still links into a function compiled after it."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _LINK_AFTER_LOAD], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]  # the first fills the cache, the second loads
    for r in runs:
        assert r.returncode == 0, r.stderr
    want = str((np.array([2.0, 3.0, 4.0])[[2, 0, 1]] ** 3).tolist())  # each row weighed three times
    assert runs[0].stdout.strip() == f"True {want}"  # compiled: numba's own module
    assert runs[1].stdout.strip() == f"False {want}"  # loaded: bitcode until a compile links it
