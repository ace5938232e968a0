"""Issue 22, item 3: what a hostile client costs the daemon is bounded by bytes, and given back.

Raw ZeroMQ DEALERs against a real daemon: a message of 400 frames of 1 MiB, and a client that
floods 4096-key fetches and never reads a reply. The daemon's resident memory must stay within
64 MiB of where it started meanwhile, come back within 8 MiB once the client is gone, and
other clients must still be answered.
"""

from __future__ import annotations

import time

import zmq

from moestream.common import protocol as P
from moestream.common.client import IodClient
from moestream.tools.status import get_status

MiB = 1 << 20


def _rss(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) << 10 for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}


def _dealer(endpoint: str, **opts: int) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        s.setsockopt(getattr(zmq, k), v)
    s.connect(endpoint)
    return s


def _settled(pid: int, start: int, timeout_s: float = 20.0) -> int:
    """The daemon's RSS once it came back near `start` (it trims its heap on its ticker), or the last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        rss = _rss(pid)["VmRSS"]
        if rss - start < 8 * MiB or time.monotonic() > deadline:
            return rss
        time.sleep(0.2)


def _baseline(d) -> int:
    with IodClient(d.endpoint, name="warm") as c:  # every code path once, so later growth is the hostile part
        c.release_many([f.result(10) for f in c.fetch([(0, e) for e in range(4)])])
        c.ping()
    time.sleep(2.5)  # a ticker trim after start-up
    return _rss(d.pid)["VmRSS"]


def test_a_message_of_400_one_mib_frames_costs_nothing_lasting(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=8)
    start = _baseline(d)
    s = _dealer(d.endpoint, SNDHWM=0)
    try:
        frame = b"\x00" * MiB
        s.send_multipart([frame] * 400, copy=False)
        time.sleep(2)
    finally:
        s.close()
    peak = _rss(d.pid)["VmHWM"]
    assert peak - start < 64 * MiB, f"peak {peak / MiB:.0f} MiB from {start / MiB:.0f} MiB"
    with IodClient(d.endpoint, name="after") as c:
        c.ping(10)
    rss = _settled(d.pid, start)
    assert rss - start < 8 * MiB, f"{rss / MiB:.0f} MiB after, {start / MiB:.0f} MiB before"


def test_a_client_that_floods_and_never_reads_is_bounded_by_bytes(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=8)
    start = _baseline(d)
    wide = [[0, e] for e in range(P.MAX_KEYS)]  # the 20 KB fetches (all decoded; out of range past 8)
    valid = [[layer, e] for layer in range(2) for e in range(8)]  # and ones the daemon must queue and serve
    flood = _dealer(d.endpoint, SNDHWM=0, RCVHWM=1, RCVBUF=4096)  # never reads what comes back
    other = IodClient(d.endpoint, name="other")
    peak, rid, sent = 0, 0, 0
    try:
        flood.send(P.Hello(P.PROTOCOL_VERSION, "flood").encode())
        t_end = time.monotonic() + 6
        while time.monotonic() < t_end:
            for _ in range(200):
                rid += 1
                try:
                    flood.send(P.Fetch(rid, wide if rid % 2 else valid).encode(), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    break
            peak = max(peak, _rss(d.pid)["VmRSS"])
            other.ping(30)  # the others are still answered meanwhile
        assert sent > 1000, sent
        assert peak - start < 64 * MiB, f"{peak / MiB:.0f} MiB during, {start / MiB:.0f} MiB before"
        st = get_status(d.status_endpoint)
        (me,) = [c for c in st["clients"] if c["name"] == "flood"]
        assert me["errors"] > 0 and me["requests"] > 0
    finally:
        flood.close()
    other.ping(10)
    other.close()
    rss = _settled(d.pid, start)
    assert rss - start < 8 * MiB, f"{rss / MiB:.0f} MiB after, {start / MiB:.0f} MiB before"
