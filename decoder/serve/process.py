"""A `moestream serve` child process on a free loopback port: what the tests and `bench serve` run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path):
        self.proc, self.url, self.log_path = proc, url, log_path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (uvicorn drains), SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_server(model: str | Path, source: Sequence[str], log_path: Path, extra: Sequence[str] = (),
                 timeout_s: float = 120.0) -> ServerProcess:
    """Start `moestream serve --model MODEL SOURCE... --port 0` and wait for the URL it prints.

    `source` is ["--resident"] or ["--iod", ENDPOINT]; its log (stderr) goes to `log_path`."""
    args = [sys.executable, "-m", "moestream", "serve", "--model", str(model), *source, "--port", "0", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            m = re.search(r"on (http://\S+)", log_path.read_text(errors="replace"))
            if m:
                return ServerProcess(proc, m.group(1), log_path)
            if proc.poll() is not None:
                raise ServerStartError(f"moestream serve exited with {proc.returncode}: "
                                       f"{log_path.read_text(errors='replace').strip()[-2000:]}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"moestream serve did not start within {timeout_s:.0f} s")
            time.sleep(0.05)
    except BaseException:
        ServerProcess(proc, "", log_path).stop()
        raise
