"""Shared fixtures: tiny GGUF models made on the fly, and a session-wide leak check.

Other suites append their fixtures below the marked sections; keep each one small.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import settings
from leakcheck import leaked_shm, session_processes, shm_entries

# Triton makes its kernels interpreted or compiled when they are defined (their module's first
# import, maybe at collection): without CUDA, every test module importing them gets the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CPU kernels quantize activations to int8 by default (as llama.cpp does: ~1e-2 of the
# output's scale); the suites compare models and kernels with float references at ~1e-5, so they
# run the float32-activation path. tests/decoder/test_int8_kernels.py tests the int8 path itself.
os.environ.setdefault("MOESTREAM_CPU_EXACT", "1")

# CI runs the same examples every time (no example database, no random seed).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    """Files the tests make to keep (trained tokenizers, demo models) go to pytest's cache folder
    of this checkout, for this process and the ones it starts, never to ~/.cache/moestream."""
    cache = getattr(config, "cache", None)
    folder = cache.mkdir("moestream") if cache is not None else Path(tempfile.mkdtemp(prefix="moestream-tests-"))
    os.environ["XDG_CACHE_HOME"] = str(folder)
    os.environ["MOESTREAM_CACHE"] = str(folder / "moestream")
    _start_kernel_warmup()


# -- the CPU kernels compile on a second core while the suites that never run them go first ------
# (a cold numba cache costs ~2 min of one core: CI's clean clone always starts cold)
_NO_KERNELS = ("tests/common/", "tests/iod/", "tests/authoring/")
_USE_KERNELS_THERE = ("test_fair_peers.py", "test_identity.py", "test_units.py")  # decoders run in these
_warmup: subprocess.Popen | None = None


def _needs_kernels(nodeid: str) -> bool:
    path = nodeid.split("::")[0]
    return not path.startswith(_NO_KERNELS) or path.endswith(_USE_KERNELS_THERE)


def _start_kernel_warmup() -> None:
    global _warmup
    _warmup = subprocess.Popen([sys.executable, "-m", "moestream.decoder.numba_setup"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_kernel_warmup() -> None:
    global _warmup
    if _warmup is not None:
        _warmup.wait()
        _warmup = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Suites that never compute with the CPU kernels first (a stable sort: each module's tests
    stay together and in order)."""
    items.sort(key=lambda item: _needs_kernels(item.nodeid))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The first test that computes with the kernels waits for their compile to finish (instead
    of compiling them a second time beside it)."""
    if _needs_kernels(item.nodeid):
        _wait_kernel_warmup()


# -- leak check ---------------------------------------------------------------------------
@pytest.fixture(scope="session", autouse=True)
def _no_leaks():
    """Fail the run if tests left shared-memory segments or child processes behind."""
    shm_before, kids_before = shm_entries(), set(session_processes())
    yield
    _wait_kernel_warmup()
    shm = leaked_shm(shm_before)
    leaked_kids = {pid: cmd for pid, cmd in session_processes().items() if pid not in kids_before}
    problems = []
    if shm:
        problems.append(f"/dev/shm entries left behind: {shm}")
    if leaked_kids:
        problems.append(f"processes left running: {leaked_kids}")
    if problems:
        pytest.fail("leak check: " + "; ".join(problems), pytrace=False)


# -- tiny models --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make_tiny_model(**make_model_kwargs) -> Path`, built once per distinct kwargs per session.

    Treat the returned file as read-only (copy it before patching bytes)."""
    from moestream.authoring.make_model import make_model

    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple, Path] = {}

    def factory(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            name = "-".join(f"{k}={v}" for k, v in key) or "default"
            cache[key] = make_model(root / f"{name}.gguf", **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model(make_tiny_model) -> Path:
    """qwen3moe, Q8_0, 2 layers x 8 experts, hidden 64: the default tiny model."""
    return make_tiny_model(arch="qwen3moe", quant="Q8_0")


# -- daemons (moestream-iod) ----------------------------------------------------------------
@pytest.fixture
def start_daemon(tmp_path: Path):
    """`start_daemon(model, **spawn_daemon_kwargs)`: a real daemon on ipc endpoints under tmp_path,
    stopped after the test."""
    from moestream.tools.spawn import spawn_daemon

    started: list = []

    def start(model: Path, **kwargs):
        d = spawn_daemon(model, run_dir=tmp_path / f"run{len(started)}", **kwargs)
        started.append(d)
        return d

    yield start
    with contextlib.ExitStack() as stack:  # every daemon is stopped even if one stop fails
        for d in started:
            stack.callback(d.stop)


@pytest.fixture
def wait_status() -> Callable[..., dict]:
    """`wait_status(status_endpoint, pred, timeout_s=10)`: poll a daemon's status until `pred(status)` holds."""

    from moestream.tools.status import get_status

    def wait(endpoint: str, pred: Callable[[dict], bool], timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            s = get_status(endpoint)
            if pred(s):
                return s
            if time.monotonic() > deadline:
                keys = ("requests", "reads", "arena", "queues", "clients")
                pytest.fail(f"daemon status never satisfied the condition; last: { {k: s[k] for k in keys} }")
            time.sleep(0.05)

    return wait
