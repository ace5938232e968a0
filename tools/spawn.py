"""Start moestream-iod as a separate process and wait until it is ready (demo, benchmarks, tests).

The daemon runs as `python -m moestream.iod.main` with `NOTIFY_SOCKET` pointing at a private
datagram socket, exactly as systemd would run it, so "ready" means the daemon said READY=1.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


class DaemonStartError(RuntimeError):
    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid  # the daemon's pid: its arena would be /dev/shm/moestream-<pid>-*


class DaemonProcess:
    """A running daemon; `stop()` (or leaving the `with` block) sends SIGTERM and waits."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path, endpoint: str, status_endpoint: str,
                 log_path: Path, own_dir: bool):
        self.proc, self.run_dir, self.log_path = proc, run_dir, log_path
        self.endpoint, self.status_endpoint = endpoint, status_endpoint
        self._own_dir = own_dir

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_daemon(model: str | Path, *, run_dir: Path | None = None, arena_slots: int | None = None,
                 arena_bytes: int | None = None, extra_args: Sequence[str] = (),
                 ready_timeout_s: float = 30.0) -> DaemonProcess:
    """Start a daemon serving `model` on ipc endpoints inside `run_dir` (a fresh temp dir by default)."""
    own = run_dir is None
    # mkdtemp's name is the prefix plus 8 characters: check the length before creating anything
    _check_path_length(Path(tempfile.gettempdir()) / ("moestream-" + "x" * 8) if own else Path(run_dir))
    run_dir = Path(tempfile.mkdtemp(prefix="moestream-")) if own else Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return _start(model, run_dir, own, arena_slots, arena_bytes, extra_args, ready_timeout_s)
    except BaseException:
        if own:  # (a started daemon's stop() has removed it already; rmtree tolerates that)
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _check_path_length(run_dir: Path) -> None:
    if len(str(run_dir)) > 90:  # sun_path is 108 bytes
        raise DaemonStartError(f"run dir {run_dir} is too long for an ipc socket path")


def _start(model: str | Path, run_dir: Path, own: bool, arena_slots: int | None, arena_bytes: int | None,
           extra_args: Sequence[str], ready_timeout_s: float) -> DaemonProcess:
    endpoint, status_endpoint = f"ipc://{run_dir}/iod.sock", f"ipc://{run_dir}/status.sock"
    args = [sys.executable, "-m", "moestream.iod.main", "--model", str(model), "--endpoint", endpoint,
            "--status-endpoint", status_endpoint]
    if arena_slots is not None:
        args += ["--arena-slots", str(arena_slots)]
    if arena_bytes is not None:
        args += ["--arena-bytes", str(arena_bytes)]
    args += list(extra_args)
    notify_path = run_dir / "notify.sock"
    log_path = run_dir / "iod.log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ns:
        ns.bind(str(notify_path))
        try:
            env = dict(os.environ, NOTIFY_SOCKET=str(notify_path))
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
            daemon = DaemonProcess(proc, run_dir, endpoint, status_endpoint, log_path, own)
            try:
                _wait_ready(daemon, ns, ready_timeout_s)
            except BaseException:  # e.g. Ctrl-C while waiting: no daemon left running
                daemon.stop()
                raise
        finally:
            notify_path.unlink(missing_ok=True)
    return daemon


def _wait_ready(daemon: DaemonProcess, ns: socket.socket, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    ns.settimeout(0.05)
    while time.monotonic() < deadline:
        try:
            if b"READY=1" in ns.recv(4096).split(b"\n"):
                return
        except TimeoutError:
            pass
        if not daemon.alive():
            lines = [ln for ln in daemon.log_text().splitlines() if ln.strip()]
            code = daemon.stop()
            raise DaemonStartError(f"moestream-iod exited with code {code}: {lines[-1] if lines else '(no output)'}",
                                   daemon.pid)
    daemon.stop()
    raise DaemonStartError(f"moestream-iod not ready within {timeout_s}s", daemon.pid)
