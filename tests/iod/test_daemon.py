"""moestream-iod end to end: real daemon processes, real sockets, tiny GGUF models.

Bytes are checked against the file itself (read at each ExpertPart's offset), counters
against sums computed here from the layout — never against the daemon's own earlier output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import checker
import pytest
from checker import check_all
from moestream.common.client import (
    FingerprintMismatch,
    IodClient,
    IodRequestError,
    IodUnavailable,
)
from moestream.common.layout import ModelLayout
from moestream.tools.status import format_status, get_status

# Takes leases, says so, then waits to be killed.
HOLD_LEASES = r"""
import sys, time
from moestream.common.client import IodClient
c = IodClient(sys.argv[1], name="victim")
leases = [f.result(10) for f in c.fetch([(0, 0), (0, 1), (1, 2)])]
print("held", len(leases), flush=True)
time.sleep(60)
"""


def run_check_all(endpoint: str, model: Path, mode: str) -> dict:
    if mode == "inprocess":
        return check_all(endpoint, str(model))
    out = subprocess.run([sys.executable, str(Path(checker.__file__)), endpoint, str(model)], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("mode", ["inprocess", "subprocess"])
@pytest.mark.parametrize("model_kw", [dict(arch="qwen3moe", quant="Q8_0"), dict(arch="qwen2moe", quant="Q4_K", experts=4)])
def test_served_bytes_equal_file(make_tiny_model, start_daemon, mode, model_kw):
    model = make_tiny_model(**model_kw)
    lay = ModelLayout(model)
    d = start_daemon(model, arena_slots=3)  # fewer slots than experts: eviction on the way
    got = run_check_all(d.endpoint, model, mode)
    n = lay.experts.n_layer * lay.experts.n_expert
    assert got["checked"] == n
    assert got["served"] == lay.experts.total_bytes
    s = get_status(d.status_endpoint)
    assert s["bytes_served"] == lay.experts.total_bytes
    assert s["arena"]["leases"] == 0


@pytest.mark.parametrize("backend", ["auto", "threads"])
def test_direct_io_serves_same_bytes(tiny_model, start_daemon, backend):
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--direct", "--backend", backend])
    got = run_check_all(d.endpoint, tiny_model, "inprocess")
    assert got["served"] == ModelLayout(tiny_model).experts.total_bytes
    s = get_status(d.status_endpoint)
    reader, registered = s["reader"], s["backend"]["registered"]
    assert registered == (reader["backend"] == "uring")
    assert ("READ_FIXED" in format_status(s)) == registered
    if registered:  # the arena is pinned with the ring: every read a READ_FIXED
        assert reader["fixed_reads"] == reader["preadv_calls"] >= got["checked"]
    else:
        assert reader["fixed_reads"] == 0


def test_concurrent_clients_single_flight(tiny_model, start_daemon):
    lay = ModelLayout(tiny_model)
    keys = [(layer, e) for layer in range(lay.experts.n_layer) for e in range(lay.experts.n_expert)]
    # each client leases every expert at once: the per-client lease quota must allow the whole arena
    d = start_daemon(tiny_model, arena_slots=len(keys), extra_args=["--queue-depth", "2", "--client-lease-share", "1"])
    barrier = threading.Barrier(3)
    results: dict[str, list] = {}

    def worker(name: str) -> None:
        with IodClient(d.endpoint, name=name) as c:
            barrier.wait()
            leases = [f.result(10) for f in c.fetch(keys)]
            results[name] = [(x.layer, x.expert) for x in leases]
            for x in leases:
                c.release(x)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(results[n] == keys for n in "abc")
    s = get_status(d.status_endpoint)
    assert s["reads"] == len(keys)  # exactly one read per expert
    assert s["misses"] == len(keys)
    assert s["hits"] + s["joined"] == 2 * len(keys)
    assert s["reader"]["bytes"] == lay.experts.total_bytes  # the reader's own count agrees
    assert s["bytes_served"] == 3 * lay.experts.total_bytes


def test_now_served_before_ahead_and_backpressure(tiny_model, start_daemon):
    # one client queues more than the arena holds: no per-client quota (share 1) for this one
    d = start_daemon(tiny_model, arena_slots=2, extra_args=["--client-lease-share", "1"])
    with IodClient(d.endpoint, name="hog") as hog, IodClient(d.endpoint, name="b") as b:
        held = [f.result(10) for f in hog.fetch([(0, 0), (0, 1)])]  # the whole arena is leased
        order: list[tuple[int, int]] = []
        lock = threading.Lock()

        def record(f):
            lease = f.result()
            with lock:
                order.append((lease.layer, lease.expert))
            b.release(lease)

        ahead = b.fetch([(1, e) for e in range(4)], priority="ahead")
        now = b.fetch([(0, 5), (0, 6)], priority="now")
        for f in ahead + now:
            f.add_done_callback(record)
        time.sleep(0.2)
        assert not any(f.done() for f in ahead + now)  # queued, not deadlocked, not failed
        hog.release(held[0])  # one slot frees: reads now go one at a time through it
        for f in ahead + now:
            f.result(10)
        assert order[:2] == [(0, 5), (0, 6)]
        assert sorted(order[2:]) == [(1, e) for e in range(4)]
        hog.release(held[1])
    s = get_status(d.status_endpoint)
    assert s["queues"]["reads_started_now"] == 2 + 2 and s["queues"]["reads_started_ahead"] == 4


def test_cancel_queued_prefetch_is_never_read(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=1)
    with IodClient(d.endpoint) as c:
        first = c.fetch([(0, 0)])[0].result(10)
        ahead = c.fetch([(1, 1), (1, 2)], priority="ahead")
        time.sleep(0.1)
        c.cancel(ahead)
        assert all(f.cancelled() for f in ahead)
        c.release(first)
        again = c.fetch([(0, 3)])[0].result(10)  # the freed slot goes to later demand work
        c.release(again)
    s = get_status(d.status_endpoint)
    assert s["queues"]["reads_started_ahead"] == 0
    assert s["reads"] == 2


def test_sigkilled_client_leases_are_freed(tiny_model, start_daemon, wait_status):
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--lease-timeout", "0.5", "--client-lease-share", "1"])
    p = subprocess.Popen([sys.executable, "-c", HOLD_LEASES, d.endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held 3"
        s = get_status(d.status_endpoint)
        assert s["arena"]["leases"] == 3 and s["clients"][0]["name"] == "victim"
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    s = wait_status(d.status_endpoint, lambda s: s["arena"]["leases"] == 0 and not s["clients"], timeout_s=10)
    assert s["clients_died"] == 1 and s["clients_expired"] == 0  # its death was seen: no lease timeout waited
    with IodClient(d.endpoint) as c:  # all four slots usable again
        leases = [f.result(10) for f in c.fetch([(1, e) for e in range(4, 8)])]
        assert len({x.slot for x in leases}) == 4


def test_status_counters_consistent(tiny_model, start_daemon):
    lay = ModelLayout(tiny_model)
    d = start_daemon(tiny_model, arena_slots=5)
    blob = {(layer, e): sum(p.nbytes for p in lay.experts.parts(layer, e))
            for layer in range(lay.experts.n_layer) for e in range(lay.experts.n_expert)}
    served = requests = 0
    with IodClient(d.endpoint) as c:
        for round_ in range(3):
            keys = [(min(round_, 1), e) for e in range(round_, round_ + 5)]  # round 2 re-uses 4 of round 1
            for f in c.fetch(keys, priority="ahead" if round_ == 1 else "now"):
                lease = f.result(10)
                served += blob[(lease.layer, lease.expert)]
                c.release(lease)
            requests += len(keys)
        c.ping()
        s = get_status(d.status_endpoint)
    assert s["requests"] == requests == s["readies"]
    assert s["hits"] + s["joined"] + s["misses"] == s["requests"]
    assert s["bytes_served"] == served
    assert s["releases"] == requests and s["arena"]["leases"] == 0
    assert s["reads"] == s["misses"] and s["bytes_read"] == s["reader"]["bytes"]
    assert s["latency"]["all"]["n"] == requests
    assert 0 < s["hit_rate"] < 1
    assert s["hottest"][0][2] >= 2
    assert s["fingerprint"]["header_sha256"] == lay.fingerprint.header_sha256
    # its CPU since it began serving (clock ticks of 10 ms): never more than its uptime on every CPU
    assert 0 <= s["cpu_s"] <= s["uptime_s"] * os.cpu_count() + 0.02


def test_fingerprint_mismatch(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=2)
    fp = dict(ModelLayout(tiny_model).fingerprint.as_dict(), header_sha256="0" * 64)
    with pytest.raises(FingerprintMismatch, match="header_sha256"):
        IodClient(d.endpoint, expect_fingerprint=fp)


def test_request_errors_vs_daemon_gone(tiny_model, start_daemon, tmp_path):
    d = start_daemon(tiny_model, arena_slots=2)
    c = IodClient(d.endpoint, timeout_s=2.0, reconnect_s=0)  # no reconnecting: a loss is final at once
    try:
        with pytest.raises(IodRequestError) as e:
            c.fetch([(99, 0)])[0].result(5)
        assert e.value.code == "out_of_range"
        held = c.fetch([(0, 0), (0, 1)])
        [f.result(5) for f in held]
        pending = c.fetch([(1, 1)])[0]  # waits for a slot
        assert d.stop() == 0  # SIGTERM while a request is queued
        with pytest.raises(IodUnavailable):
            pending.result(5)
        with pytest.raises(IodUnavailable):
            c.fetch([(0, 2)])[0].result(5)
    finally:
        c.close()
    with pytest.raises(IodUnavailable, match="no answer"):
        IodClient(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.3)


def test_sigterm_cleans_up(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=2)
    with IodClient(d.endpoint) as c:
        arena = Path("/dev/shm") / c.welcome["arena_name"]
        assert arena.exists() and (arena.stat().st_mode & 0o777) == 0o640  # group read-only
        [f.result(5) for f in c.fetch([(0, 0)])]  # exit with a lease held
        sock = Path(d.endpoint[len("ipc://"):])
        assert (sock.stat().st_mode & 0o777) == 0o660
        assert d.stop() == 0
    assert not arena.exists()
    assert not sock.exists() and not Path(d.status_endpoint[len("ipc://"):]).exists()


def test_notify_ready_and_main_module(tiny_model, tmp_path):
    """`python -m moestream.iod.main` under a NOTIFY_SOCKET: READY=1, then STOPPING=1 on SIGTERM."""
    import signal
    import socket

    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(str(tmp_path / "n.sock"))
    ns.settimeout(15)
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "n.sock"))
    p = subprocess.Popen([sys.executable, "-m", "moestream.iod.main", "--model", str(tiny_model), "--arena-slots", "2",
                          "--endpoint", f"ipc://{tmp_path}/a.sock", "--status-endpoint", f"ipc://{tmp_path}/s.sock"],
                         env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert b"READY=1" in ns.recv(4096)
        assert get_status(f"ipc://{tmp_path}/s.sock")["pid"] == p.pid
        p.send_signal(signal.SIGTERM)
        assert b"STOPPING=1" in ns.recv(4096)
        assert p.wait(15) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
        ns.close()


def test_stale_prefetch_dropped_and_full_queue_busy(tiny_model, start_daemon, tmp_path):
    cfg = tmp_path / "iod.toml"
    cfg.write_text("ahead_max_age_s = 0.3\nmax_queued = 3\nlease_timeout = 1.0\nclient_lease_share = 1.0\n")
    d = start_daemon(tiny_model, arena_slots=1, extra_args=["--config", str(cfg)])
    with IodClient(d.endpoint) as c:
        held = c.fetch([(0, 0)])[0].result(10)  # the only slot: everything else queues
        ahead = c.fetch([(1, 0), (1, 1)], priority="ahead")
        now = c.fetch([(0, 1), (0, 2)])  # queue: 2 ahead + 2 now > 3: the oldest prefetch goes
        with pytest.raises(IodRequestError) as e:
            ahead[0].result(10)
        assert e.value.code == "dropped"
        with pytest.raises(IodRequestError) as e:
            ahead[1].result(10)  # stale after 0.3 s, dropped by the daemon's ticker
        assert e.value.code == "dropped" and "stale" in e.value.message
        with pytest.raises(IodRequestError) as e:
            c.fetch([(1, 5), (1, 6)])[1].result(10)  # 2 now queued + 2 more > 3, none to drop
        assert e.value.code == "busy"
        c.release(held)
        for f in now:
            c.release(f.result(10))
    s = get_status(d.status_endpoint)
    assert s["queues"]["dropped"] == 2 and s["queues"]["refused_busy"] == 1
    assert s["queues"]["reads_started_ahead"] == 0


def test_client_notices_a_killed_daemon_fast(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=1)  # default lease timeout: pings alone would take 15 s
    c = IodClient(d.endpoint, timeout_s=5.0, reconnect_s=0)  # no reconnecting: a loss is final at once
    arena = Path("/dev/shm") / c.welcome["arena_name"]
    try:
        held = c.fetch([(0, 0)])[0].result(10)
        pending = c.fetch([(0, 1)])[0]  # queued behind the lease
        t0 = time.monotonic()
        d.proc.kill()
        with pytest.raises(IodUnavailable, match="lost the connection"):
            pending.result(4)
        assert time.monotonic() - t0 < 4
        assert c.voided(held)  # the lost connection's leases are void: releasing one is a no-op
        c.release(held)
    finally:
        c.close()
        d.stop()
    assert arena.exists()  # SIGKILL leaves the segment behind; the next daemon removes it
    d2 = start_daemon(tiny_model, arena_slots=1)
    assert not arena.exists()
    assert "left by a daemon that died" in d2.log_text()
    with IodClient(d2.endpoint) as c2:
        c2.ping()


@pytest.mark.parametrize("uses", [None, [6, 1, 1, 1]])
def test_the_rows_a_fetch_serves_weigh_in_the_arenas_policy(tiny_model, start_daemon, uses):
    """The rows a `now` fetch says each expert serves count as uses (a prompt's tokens): the expert
    six rows chose outlives three used once when a fifth needs a slot. Without them all four
    weigh the same and the least recent, that same expert, goes first."""
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--client-lease-share", "1"])
    with IodClient(d.endpoint, name="uses") as c:
        for keys, n in (([(0, e) for e in range(4)], uses), ([(0, 4)], None)):  # the 5th evicts one
            for x in [f.result(10) for f in c.fetch(keys, "now", n)]:
                c.release(x)
        before = get_status(d.status_endpoint)
        c.release(c.fetch([(0, 0)])[0].result(10))
        after = get_status(d.status_endpoint)
    assert after["hits"] - before["hits"] == (1 if uses else 0)
    assert after["misses"] - before["misses"] == (0 if uses else 1)


@pytest.mark.parametrize("rows", [None, [5]])
def test_the_rows_a_touch_reports_weigh_in_the_arenas_policy(tiny_model, start_daemon, rows):
    """A lease-free hit reported with the rows it served counts them as uses: expert 1 (one
    request, then 5 rows) outweighs expert 0 (3 rows) when the last of three new experts needs a
    slot; reported without rows it weighs 2 and goes instead."""
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--client-lease-share", "1"])
    with IodClient(d.endpoint, name="rows") as c:
        for x in [f.result(10) for f in c.fetch([(0, e) for e in range(4)], "now", [3, 1, 1, 1])]:
            c.release(x)
        c.touch(0, [1], rows)
        c.ping(10)  # (the touch goes out behind the ping, before the fetch below)
        for x in [f.result(10) for f in c.fetch([(0, 4), (0, 5), (0, 6)])]:  # in place of 2, 3, then 0 or 1
            c.release(x)
        before = get_status(d.status_endpoint)
        c.release(c.fetch([(0, 1)])[0].result(10))
        after = get_status(d.status_endpoint)
    assert after["hits"] - before["hits"] == (1 if rows else 0)
