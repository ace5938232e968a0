"""`moestream bench io`: expert delivery to a client process beside the raw limit, in one run.

Phases (each over the same randomly chosen experts, in the same order):
  cold raw        page cache evicted (POSIX_FADV_DONTNEED) before each: fio (io_uring, depth D,
                  if installed) replays the exact ranges, and a batched preadv pool at depth D
                  reads them; the faster of the two is the limit;
  cold delivered  evicted again, a fresh daemon serves every expert to this process, which
                  copies each part out of the shared-memory arena (so the bytes really arrive);
  warm raw        memcpy of the same ranges from the page cache (the file's mmap), best of 2;
  warm delivered  a fresh daemon (empty arena) serves them again, now from the page cache;
  host-tier hit   round trip of `fetch` for an expert already in the arena (no I/O), p50/p99,
                  beside a bare ZeroMQ ipc echo (a blocking python ROUTER in a child process)
                  timed in the same run: hit ÷ echo is the request overhead on this machine.
Ratios are delivered GB/s ÷ raw GB/s, both counting the experts' bytes.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import mmap
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moestream.common.layout import PAGE, ModelLayout, round_up

from .readers import BACKENDS, open_reader, plan_reads, proc_read_bytes, slot_pieces

Key = tuple[int, int]
RUNS = ("cold_raw_fio", "cold_raw_preadv", "cold", "warm_raw", "warm")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream bench io", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the GGUF MoE file to read experts from")
    p.add_argument("--iod", metavar="ENDPOINT", help="use this running daemon instead of spawning one "
                   "(cold/warm then depend on what it already holds)")
    p.add_argument("--status-endpoint", help="with --iod: its status endpoint (for bytes read from disk)")
    p.add_argument("--experts", type=int, help="how many experts to move (default: all of them)")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="spawned daemon's reader")
    p.add_argument("--depth", type=int, default=32, help="reads in flight, daemon and raw (default 32)")
    p.add_argument("--direct", action="store_true", help="O_DIRECT reads for the daemon and the raw limit "
                   "(cold without evicting the page cache)")
    p.add_argument("--arena-bytes", default="1GiB", help="spawned daemon's arena (default 1GiB)")
    p.add_argument("--hits", type=int, default=1000, help="host-tier hit round trips to time (default 1000)")
    p.add_argument("--no-fio", action="store_true", help="measure the cold raw limit with preadv even if fio exists")
    p.add_argument("--repeat", type=int, default=1, help="alternate raw and delivered runs this many times; "
                   "report medians (default 1; use 3+ on a busy machine)")
    p.add_argument("--seed", type=int, default=0, help="which experts, in which order")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


# -- inputs ---------------------------------------------------------------------------------
def pick_keys(layout: ModelLayout, n: int | None, seed: int) -> list[Key]:
    """`n` (default all) experts of the MoE layers (not the dense-FFN ones), in a random order."""
    ex = layout.experts
    keys = [(layer, e) for layer in ex.moe_layers for e in range(ex.n_expert)]
    random.Random(seed).shuffle(keys)  # decoding touches experts in no file order
    return keys[: n or len(keys)]


def expert_ranges(layout: ModelLayout, keys: list[Key]) -> list[tuple[int, int, int]]:
    """(file, offset, nbytes) of each part of each key: the file is a part of a split model (else 0)."""
    return [(p.file, p.offset, p.nbytes) for k in keys for p in layout.experts.parts(*k)]


def evict(layout: ModelLayout) -> None:
    """Drop the model's clean pages (every part's) from the page cache (no root needed)."""
    for f in layout.files:
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def phase(name: str, nbytes: int, seconds: float, disk: int | None = None, **extra: object) -> dict:
    return {"name": name, "bytes": nbytes, "seconds": seconds, "gb_s": nbytes / seconds / 1e9 if seconds > 0 else None,
            "disk_read_bytes": disk, **extra}


# -- raw limits -----------------------------------------------------------------------------
def raw_cold_reads(layout: ModelLayout, keys: list[Key], depth: int, direct: bool, backend: str = "threads") -> dict:
    """The same ranges through a plain preadv pool at `depth` (or another reader `backend`: "auto"
    is the daemon's own choice, io_uring where it works), into a scratch ring (data discarded)."""
    ex = layout.experts
    slot = ex.slot_bytes(direct)
    ring_slots = max(1, min(len(keys), 2 * depth))
    ring = mmap.mmap(-1, slot * ring_slots)
    done, left = threading.Event(), [len(keys)]
    lock, errors = threading.Lock(), []

    def on_done(err: BaseException | None) -> None:
        with lock:
            errors.extend([err] if err else [])
            left[0] -= 1
            if not left[0]:
                done.set()

    with open_reader([str(f.path) for f in layout.files], backend=backend, depth=depth, direct=direct) as reader:
        fixed = reader.register(slot_pieces(memoryview(ring), slot)) == ""  # as the daemon reads into its arena
        tool = f"{'preadv' if reader.name == 'threads' else 'io_uring'}{' READ_FIXED' if fixed else ''} x{depth}"
        io0, t0 = proc_read_bytes(), time.perf_counter()
        for i, k in enumerate(keys):  # slots reused round-robin: overlapping writes of discarded data are fine
            ops, _ = plan_reads(ex.parts(*k), memoryview(ring)[(i % ring_slots) * slot : (i % ring_slots + 1) * slot], direct=direct)
            reader.submit(ops, on_done)
        done.wait()
        seconds, disk = time.perf_counter() - t0, proc_read_bytes() - io0
        read = reader.stats()["bytes"]
        del ops
    ring.close()
    if errors:
        raise RuntimeError(f"raw preadv failed: {errors[0]}")
    return phase("cold raw", _useful(layout, keys), seconds, disk, tool=tool, read_bytes=read)


def raw_cold_fio(layout: ModelLayout, keys: list[Key], depth: int, direct: bool, fio: str) -> dict:
    """fio replaying the exact ranges with io_uring at `depth` (aligned ranges when direct)."""
    ranges = _aligned(expert_ranges(layout, keys)) if direct else expert_ranges(layout, keys)
    paths = [str(f.path) for f in layout.files]  # every part of a split model
    with tempfile.NamedTemporaryFile("w", suffix=".iolog", delete=False) as f:
        f.write("fio version 2 iolog\n")
        f.writelines(f"{p} add\n{p} open\n" for p in paths)
        f.writelines(f"{paths[file]} read {off} {n}\n" for file, off, n in ranges)
        f.writelines(f"{p} close\n" for p in paths)
    cmd = [fio, "--name=raw", "--ioengine=io_uring", f"--iodepth={depth}", f"--read_iolog={f.name}",
           "--replay_no_stall=1", "--fadvise_hint=random", f"--direct={int(direct)}", "--output-format=json"]
    try:
        blocks0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        disk = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks0) * 512
    finally:
        os.unlink(f.name)
    if out.returncode:
        raise RuntimeError(f"fio failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    # fio's io_bytes leaves out the last depth-1 replayed reads, so count the ranges ourselves.
    seconds = max(job["job_runtime"], 0.5) / 1e3  # reported in whole ms: tiny runs show 0
    return phase("cold raw", _useful(layout, keys), seconds, disk, tool=f"fio io_uring x{depth}")


def raw_warm_memcpy(layout: ModelLayout, keys: list[Key], dst: np.ndarray) -> dict:
    """memcpy of the same ranges from the page cache (the file's mmap); best of two passes."""
    data = [np.memmap(f.path, dtype=np.uint8, mode="r") for f in layout.files]
    ranges = expert_ranges(layout, keys)
    best = float("inf")
    for _ in range(2):  # the first pass also maps the pages
        t0 = time.perf_counter()
        for file, off, n in ranges:
            dst[:n] = data[file][off : off + n]
        best = min(best, time.perf_counter() - t0)
    del data
    return phase("warm raw", _useful(layout, keys), best, tool="memcpy from page cache")


# -- delivery -------------------------------------------------------------------------------
def deliver(client, keys: list[Key], dst: np.ndarray) -> tuple[float, int]:
    """Fetch every key, copy each part out of the arena into `dst`, release; (seconds, bytes copied)."""
    t0, copied = time.perf_counter(), 0
    futures = client.fetch(keys, "now")
    for fut in cf.as_completed(futures):
        lease = fut.result()
        pos = 0
        for part in lease.parts:
            view = np.frombuffer(client.part_view(lease, part), dtype=np.uint8)
            dst[pos : pos + len(view)] = view  # the bytes really reach this process
            pos += len(view)
        copied += pos
        client.release(lease)
    return time.perf_counter() - t0, copied


def make_resident(client, hot: list[Key]) -> None:
    for f in client.fetch(hot):
        client.release(f.result())


def hit_round_trips(client, hot: list[Key], n: int) -> dict:
    """Fetch-to-lease time of experts already in the arena (see `make_resident`)."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        lease = client.fetch([hot[i % len(hot)]])[0].result()
        times.append(time.perf_counter() - t0)
        client.release(lease)
    us = np.array(times) * 1e6
    pings = np.array([client.ping() for _ in range(min(n, 200))]) * 1e6  # the transport's own floor
    return {"requests": n, "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "ping_p50_us": float(np.percentile(pings, 50))}


def echo_floor(n: int, timeout_s: float = 10.0) -> dict:
    """Round trip of a bare ZeroMQ ipc echo in this run (blocking DEALER here, ROUTER in a child)."""
    import zmq

    with tempfile.TemporaryDirectory(prefix="moestream-echo-") as tmp:
        endpoint = f"ipc://{tmp}/echo.sock"
        proc = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(endpoint,), daemon=True)
        proc.start()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))  # a dead echo process fails, never hangs
        sock.connect(endpoint)
        try:
            times = _echo_times(sock, n)
        finally:
            _stop_echo(sock, proc)
    us = np.array(times) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


def _echo_times(sock, n: int) -> list[float]:
    import zmq

    msg, times = b"x" * 48, []  # about the size of a fetch
    try:
        for i in range(n + n // 10 + 1):  # the first tenth warms up (and waits for the bind)
            t0 = time.perf_counter()
            sock.send(msg)
            sock.recv()
            if i > n // 10:
                times.append(time.perf_counter() - t0)
    except zmq.Again:
        raise RuntimeError("the ZeroMQ echo process did not answer") from None
    return times


def _stop_echo(sock, proc: multiprocessing.Process) -> None:
    with contextlib.suppress(Exception):
        sock.send(b"")  # an empty frame asks it to exit
    proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join()
    sock.close(linger=0)


def _echo_server(endpoint: str) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        ident, body = sock.recv_multipart()
        if not body:
            break
        sock.send_multipart([ident, body])
    ctx.destroy(linger=0)


@contextlib.contextmanager
def daemon(args: argparse.Namespace) -> Iterator[tuple[str, str | None, int | None]]:
    """(endpoint, status endpoint, pid): the given daemon, or a fresh one spawned for this phase."""
    if args.iod:
        yield args.iod, args.status_endpoint, None
        return
    from moestream.tools.spawn import spawn_daemon

    # one client measuring delivery: no per-client lease quota (it would cap the loads in flight)
    extra = ["--backend", args.backend, "--queue-depth", str(args.depth), "--client-lease-share", "1"] + \
        (["--direct"] if args.direct else [])
    with spawn_daemon(args.model, arena_bytes=args.arena_bytes, extra_args=extra) as d:
        yield d.endpoint, d.status_endpoint, d.pid


def delivery_phase(args: argparse.Namespace, name: str, keys: list[Key], dst: np.ndarray, layout: ModelLayout,
                   hits: int = 0) -> dict:
    from moestream.common.client import IodClient
    from moestream.tools.status import get_status

    with daemon(args) as (endpoint, status_ep, pid), IodClient(endpoint, name="bench-io") as client:
        _map_arena(client)
        io0 = proc_read_bytes(pid) if pid else -1
        seconds, copied = deliver(client, keys, dst)
        io1 = proc_read_bytes(pid) if pid else -1
        status = get_status(status_ep) if status_ep else {}
        result = phase(name, copied, seconds, io1 - io0 if min(io0, io1) >= 0 else None,
                       backend=status.get("backend", {}), served_bytes=status.get("bytes_served"),
                       in_flight=_in_flight(status))
        if copied != _useful(layout, keys):
            raise RuntimeError(f"{name}: delivered {copied} bytes, expected {_useful(layout, keys)}")
        if hits:
            result["hit"] = hit_phase(client, keys[:8], hits, status_ep)
    return result


def _in_flight(status: dict) -> dict | None:
    """How deep the daemon went: device reads and expert loads in flight (peak, time-weighted mean)."""
    reads, loads = status.get("reader", {}).get("in_flight"), status.get("queues", {}).get("in_flight")
    if not reads or not loads:
        return None  # a daemon without depth counters (--iod on an older one)
    return {"reads_peak": reads["peak"], "reads_mean": reads["mean"], "loads_peak": loads["peak"],
            "loads_mean": loads["mean"]}


def hit_phase(client, hot: list[Key], n: int, status_ep: str | None) -> dict:
    from moestream.tools.status import get_status

    make_resident(client, hot)
    before = get_status(status_ep) if status_ep else None
    result = hit_round_trips(client, hot, n)
    if before is not None:
        after = get_status(status_ep)
        result["hit_rate"] = (after["hits"] - before["hits"]) / max(1, after["requests"] - before["requests"])
    echo = echo_floor(n)  # right after the hits: same machine load
    result.update(echo_p50_us=echo["p50_us"], echo_p99_us=echo["p99_us"],
                  p50_vs_echo=result["p50_us"] / echo["p50_us"], p99_vs_echo=result["p99_us"] / echo["p99_us"])
    return result


# -- report ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    layout = ModelLayout(args.model)
    keys = pick_keys(layout, args.experts, args.seed)
    dst = np.empty(layout.experts.max_blob_bytes, dtype=np.uint8)
    dst.fill(0)  # fault the destination in before any timing
    fio = None if args.no_fio else shutil.which("fio")
    runs: dict[str, list[dict]] = {name: [] for name in RUNS}
    for i in range(args.repeat):  # alternate raw and delivered so drift hits both alike
        if fio:
            evict(layout)
            runs["cold_raw_fio"].append(raw_cold_fio(layout, keys, args.depth, args.direct, fio))
        evict(layout)
        runs["cold_raw_preadv"].append(raw_cold_reads(layout, keys, args.depth, args.direct))
        evict(layout)
        runs["cold"].append(delivery_phase(args, "cold delivered", keys, dst, layout))
        runs["warm_raw"].append(raw_warm_memcpy(layout, keys, dst))
        runs["warm"].append(delivery_phase(args, "warm delivered", keys, dst, layout,
                                           hits=args.hits if i == args.repeat - 1 else 0))
    out: dict = {"model": str(layout.path), "experts": len(keys), "bytes": _useful(layout, keys),
                 "depth": args.depth, "direct": args.direct, "repeat": args.repeat, "notes": []}
    out["hit"] = runs["warm"][-1].pop("hit")  # before the medians copy that run
    out.update({name: _median(phases) for name, phases in runs.items() if phases})
    # The cold limit is the better raw method measured in this run.
    out["cold_raw"] = max((out[k] for k in ("cold_raw_fio", "cold_raw_preadv") if k in out), key=lambda ph: ph["gb_s"])
    out["cold_ratio"] = out["cold"]["gb_s"] / out["cold_raw"]["gb_s"]
    out["warm_ratio"] = out["warm"]["gb_s"] / out["warm_raw"]["gb_s"]
    _add_notes(out, args, fio)
    return out


def _median(phases: list[dict]) -> dict:
    """The run with the median rate, with every run's GB/s alongside."""
    ordered = sorted(phases, key=lambda ph: ph["gb_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_gb_s": [round(ph["gb_s"], 3) for ph in phases]}


def _add_notes(out: dict, args: argparse.Namespace, fio: str | None) -> None:
    notes = out["notes"]
    if not fio and not args.no_fio:
        notes.append("fio not installed (apt-get install fio): cold raw limit from the batched preadv pool only")
    disk = out["cold"]["disk_read_bytes"]
    if disk is not None and disk < 0.5 * out["bytes"] and not args.direct:
        notes.append("cold delivery read little from disk: the page cache was not evicted; rerun with --direct")
    if args.iod:
        notes.append("--iod: the daemon's arena may already hold these experts (cold/warm not guaranteed)")
    if args.direct:
        notes.append("--direct: the daemon reads around the page cache, so 'warm' delivery also reads the disk")


def format_table(r: dict) -> str:
    gb = lambda n: "-" if n is None else f"{n / 1e9:.2f} GB"  # noqa: E731
    be = r["cold"].get("backend") or {}
    lines = [f"moestream bench io: {Path(r['model']).name}: {r['experts']} experts, {gb(r['bytes'])}, "
             f"reader {be.get('name', '?')} depth {r['depth']}{' O_DIRECT' if r['direct'] else ''}",
             f"{'':36}{'GB/s':>8}{'ratio':>8}{'read from disk':>16}"]
    for key, ratio in (("cold_raw_fio", None), ("cold_raw_preadv", None), ("cold", "cold_ratio"),
                       ("warm_raw", None), ("warm", "warm_ratio")):
        if key not in r:
            continue
        ph = r[key]
        label = f"{ph['name']} ({ph['tool']})" if "tool" in ph else ph["name"]
        lines.append(f"{label:<36}{ph['gb_s']:>8.2f}{'' if ratio is None else f'{r[ratio]:.2f}':>8}{gb(ph['disk_read_bytes']):>16}")
    for key in ("cold", "warm"):
        d = r.get(key, {}).get("in_flight")
        if d:
            lines.append(f"{key} delivered depth: reads in flight peak {d['reads_peak']}, mean {d['reads_mean']:.1f}; "
                         f"expert loads peak {d['loads_peak']}, mean {d['loads_mean']:.1f}")
    h = r["hit"]
    lines.append(f"host-tier hit round trip: p50 {h['p50_us']:.0f} µs, p99 {h['p99_us']:.0f} µs "
                 f"({h['requests']} requests{', hit rate %.2f' % h['hit_rate'] if 'hit_rate' in h else ''}; "
                 f"ping p50 {h['ping_p50_us']:.0f} µs)")
    if "echo_p50_us" in h:
        lines.append(f"  vs bare ZeroMQ ipc echo p50 {h['echo_p50_us']:.0f} µs, p99 {h['echo_p99_us']:.0f} µs: "
                     f"hit/echo {h['p50_vs_echo']:.2f} at p50, {h['p99_vs_echo']:.2f} at p99")
    if r["repeat"] > 1:
        lines.append("medians of " + ", ".join(f"{k} {r[k]['runs_gb_s']}" for k in RUNS if k in r))
    lines.append(f"cold ratio is against the faster raw method ({r['cold_raw']['tool']})")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except Exception as e:  # one clear line: model errors, daemon start failures, fio trouble
        print(f"moestream bench io: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


# -- helpers --------------------------------------------------------------------------------
def _useful(layout: ModelLayout, keys: list[Key]) -> int:
    return sum(n for _, _, n in expert_ranges(layout, keys))


def _aligned(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The enclosing page-aligned range of each, as O_DIRECT reads them."""
    return [(file, off - off % PAGE, round_up(off % PAGE + n, PAGE)) for file, off, n in ranges]


def _map_arena(client) -> None:
    """Touch one byte per page of the arena view: a long-running decoder has it mapped already,
    and first-touch page faults would otherwise halve the copy rate of a fresh client."""
    for i in range(client.arena.n_slots):
        int(np.frombuffer(client.arena.slot(i), dtype=np.uint8)[::PAGE].sum())
