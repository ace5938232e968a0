"""One moestream run of `moestream bench capped`: `moestream-iod` and `moestream generate` as two
processes in the run's memory cgroup, watched by a `Sampler`; its figures (speed, disk bytes by
phase, the daemon's counters, the routing trace replayed through an ideal LRU of the arena's size).

The daemon reads with O_DIRECT unless the plan says otherwise: with page-cache reads, the file's
pages are charged to the cgroup beside the arena, the same bytes cached twice under one cap.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ....common.client import IodError, IodUnavailable
from ....common.traces import load_trace
from ....tools.spawn import DaemonProcess
from ....tools.status import get_status
from .plan import Plan, Split
from .cgroup_run import CgroupParent, cgroup, failure, last_json, run_watched, usage, wrapped
from .host_counters import Sampler, disk_figures, last_line
from .routing_replay import ideal_lru, routing_spread

DAEMON_READY_S = 120.0
DAEMON_STOP_S = 15.0


def endpoints(run_dir: Path) -> tuple[str, str]:
    """The daemon's request and status endpoints for one run."""
    return f"ipc://{run_dir}/iod.sock", f"ipc://{run_dir}/status.sock"


def decoder_command(plan: Plan, endpoint: str | None, trace: Path) -> list[str]:
    """`moestream generate` streamed from `endpoint`, or --resident when it is None."""
    cmd = [sys.executable, "-m", "moestream.decoder.cli", "--model", plan.model,
           *(["--iod", endpoint] if endpoint else ["--resident"]),
           "--prompt-ids", ",".join(map(str, plan.prompt)), "-n", str(plan.tokens), "--json",
           "--trace-out", str(trace), "--prefetch", str(plan.prefetch), "--no-progress"]
    if plan.temperature > 0:
        cmd += ["--temperature", str(plan.temperature), "--seed", str(plan.seed)]
    if plan.force_routing:
        cmd += ["--force-routing", str(plan.force_routing)]
    return cmd + plan.decoder_args


def daemon_command(plan: Plan, run_dir: Path, split: Split | None) -> list[str]:
    """`moestream-iod` for one run: O_DIRECT or not as planned, sized by `split` (none: uncapped)."""
    endpoint, status_endpoint = endpoints(run_dir)
    cmd = [sys.executable, "-m", "moestream.iod.main", "--model", plan.model, "--endpoint", endpoint,
           "--status-endpoint", status_endpoint, "--direct" if plan.direct else "--no-direct"]
    if split is None:
        return cmd
    if plan.daemon_memory_flag:
        return [*cmd, "--memory", str(split.daemon_budget)]
    return [*cmd, "--arena-bytes", str(split.arena_bytes)]


class Daemon:
    """moestream-iod started from `cmd` (already wrapped into a cgroup), ready once its status
    socket answers; `stop()` stops it as `DaemonProcess` does and removes an arena a killed
    daemon left."""

    def __init__(self, cmd: list[str], run_dir: Path, env: dict[str, str], ready_timeout_s: float = DAEMON_READY_S):
        log = run_dir / "iod.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env)
        self.process = DaemonProcess(proc, run_dir, *endpoints(run_dir), log, own_dir=False)
        self.endpoint = self.process.endpoint
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.alive():
                code = self.process.proc.returncode
                raise RuntimeError(f"moestream-iod exited with code {code}: {last_line(self.process.log_path)}")
            try:
                get_status(self.process.status_endpoint, 0.25)
                return
            except IodUnavailable:
                continue
        raise RuntimeError(f"moestream-iod not ready within {timeout_s:.0f} s: {last_line(self.process.log_path)}")

    def served(self) -> bool:
        """Has the daemon served any request yet?"""
        s = self.status(0.5)
        return bool(s and s["requests"])

    def status(self, timeout_s: float = 3.0) -> dict | None:
        try:
            return get_status(self.process.status_endpoint, timeout_s)
        except IodError:
            return None

    def stop(self) -> int | None:
        code = self.process.stop(DAEMON_STOP_S)
        for stale in Path("/dev/shm").glob(f"moestream-{self.pid}-*"):
            stale.unlink(missing_ok=True)
        return code


def run_moestream(plan: Plan, layout: Any, parent: CgroupParent | None, split: Split | None, tag: str,
                  resident: bool = False) -> dict[str, Any]:
    """One moestream run: daemon + decoder in one cgroup capped at `split.cap` (uncapped without
    a split; no daemon with `resident`). Returns the run's figures, or {"error": ...}."""
    try:
        return _run_moestream(plan, layout, parent, split, tag, resident)
    except RuntimeError as e:  # the daemon did not start (e.g. it refused the budget): this run failed
        return {"error": str(e)}


def _run_moestream(plan: Plan, layout: Any, parent: CgroupParent | None, split: Split | None, tag: str,
                   resident: bool) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"ms-{tag}-", dir=plan.workdir))
    log, trace = run_dir / "decoder.log", run_dir / "trace.json"
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(cgroup(parent, split.cap if split and plan.capped else None, tag))
        daemon = None
        if not resident:
            daemon = Daemon(wrapped(group, daemon_command(plan, run_dir, split)), run_dir, plan.env())
            stack.callback(daemon.stop)
        # (the uncapped warm-up measures the processes' working sets: what the caps' split takes)
        sampler = Sampler(plan.block_stat, {"daemon": daemon.pid} if daemon else {}, daemon.served if daemon else None,
                          working_set=split is None)
        cmd = wrapped(group, decoder_command(plan, daemon.endpoint if daemon else None, trace))
        code, out = run_watched(cmd, plan.env(), plan.timeout_s, log, sampler, "decoder")
        status = daemon.status() if daemon else None
        if code != 0:
            return {"error": failure("moestream generate", code, log, group)}
        figures = _moestream_figures(last_json(out), sampler, status, layout, trace, plan.disk_counter)
        return {**figures, **usage(group)}


def _moestream_figures(result: dict, sampler: Sampler, status: dict | None, layout: Any, trace: Path,
                       disk_counter: str) -> dict[str, Any]:
    steps = load_trace(trace)
    hp = layout.hparams
    stats = result.get("stats", {})
    decode_tokens = max(0, result["new_tokens"] - 1)
    out: dict[str, Any] = {
        "decode_tok_s": result["decode_tok_s"], "prefill_s": result["prefill_s"], "decode_s": result["decode_s"],
        "load_s": result.get("load_s"), "new_tokens": result["new_tokens"], "tokens": result["tokens"],
        "stall_s": stats.get("stall_s"), "fetched_bytes": stats.get("bytes_fetched"),
        "compute_s": stats.get("compute_s"), "peak_decoder": sampler.peak.get("decoder"), "trace_path": str(trace),
        "miss_share": stats.get("miss_share"), "prefetch_hints": (result.get("prefetch") or {}).get("hints"),
        "prefetch_wide": (result.get("prefetch") or {}).get("wide"),
        "peak_daemon": sampler.peak.get("daemon"), "need_decoder": sampler.need("decoder"),
        "need_daemon": sampler.need("daemon"), "spread": routing_spread(steps, hp.n_layer, hp.n_expert)}
    out.update(_moestream_disk(sampler, result["prefill_s"], result["decode_s"], decode_tokens, disk_counter))
    out.update(_daemon_cpu(sampler, result["prefill_s"], result["decode_s"], out.get("disk_per_token"),
                           decode_tokens, layout))
    if status is not None:
        out.update(_daemon_figures(status, steps, layout))
    return out


def _daemon_cpu(sampler: Sampler, prefill_s: float, decode_s: float, disk_per_token: float | None,
                decode_tokens: int, layout: Any) -> dict[str, Any]:
    """The daemon's CPU seconds in the decode steps, and per expert read (its disk bytes over the
    mean expert's): on a host with no core to spare beside the decoder's threads, the daemon's time
    comes out of the kernels'."""
    if sampler.start is None:
        return {}
    cpu = sampler.cpu_delta(*_decode_span(sampler, prefill_s, decode_s), "daemon")
    if cpu is None:
        return {}
    ex = layout.experts
    reads = disk_per_token * decode_tokens / (ex.total_bytes / ex.n_blobs) if disk_per_token else 0
    return {"daemon_cpu_s": cpu, "daemon_cpu_ms_per_read": 1e3 * cpu / reads if reads >= 1 else None}


def _daemon_figures(status: dict, steps: list, layout: Any) -> dict[str, Any]:
    """The daemon's arena and counters, and the ideal LRU of as many slots as its arena has."""
    arena = status["arena"]
    ex = layout.experts
    lru = ideal_lru(steps, arena["n_slots"], ex.total_bytes / ex.n_blobs)
    busy = status.get("reader", {}).get("in_flight", {}).get("busy_s")  # seconds with a read in flight
    return {"arena_slots": arena["n_slots"], "arena_bytes": arena["arena_bytes"], "daemon_hit_rate": status["hit_rate"],
            "daemon_read_bytes": status["bytes_read"], "daemon_reads": _reads(status), "lru": lru,
            "lru_missed_per_token": lru.get("missed_bytes_per_token"),
            "daemon_read_bytes_per_s": status["bytes_read"] / busy if busy else None}


def _reads(status: dict) -> str:
    """How the daemon says it reads: a label the medians keep when every run agrees."""
    return "O_DIRECT" if status.get("backend", {}).get("direct") else "page cache"


def _decode_span(sampler: Sampler, prefill_s: float, decode_s: float) -> tuple[int, int]:
    """The samples that bound the decode steps, by the decoder's own phase times (as llama.cpp's
    side marks its own): not to the process's end, whose exit faulted back ~60 MB of library pages
    that `footprint.trim` had paged out (with this VM's 8 MB readahead), counted as decode reads."""
    start = sampler.start + prefill_s
    return sampler.at(start), sampler.at(start + decode_s)


def _moestream_disk(sampler: Sampler, prefill_s: float, decode_s: float, decode_tokens: int,
                    mode: str) -> dict[str, Any]:
    """Disk bytes by phase: load (to the first request), prefill and decode (their reported times)."""
    if sampler.start is None:
        return {"disk_per_token": None, "disk_source": None}
    first = max(0, sampler.at(sampler.start) - 1)
    marks = [0, first, *_decode_span(sampler, prefill_s, decode_s)]
    block, own, by_name = {}, {}, {}
    for phase, i, j in zip(("load", "prefill", "decode"), marks, marks[1:], strict=False):
        block[phase] = sampler.delta(i, j)
        by_name[phase] = {name: sampler.delta(i, j, name) or 0 for name in ("daemon", "decoder")}
        own[phase] = sum(by_name[phase].values())
    return {**disk_figures(block, own, decode_tokens, mode), "own_reads": by_name}
