"""Issue 22, item 3: what a hostile client costs the daemon is bounded by bytes, and given back.

Raw ZeroMQ DEALERs against a real daemon: a message of 400 frames of 1 MiB, and a client process
that floods 4096-key fetches, never reads a reply, and exits. The daemon's resident memory must stay within
64 MiB of where it started meanwhile, come back within 8 MiB once the client is gone, and
other clients must still be answered.
"""

from __future__ import annotations

import subprocess
import sys
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


# Floods for `seconds`: 20 KB fetches of 4096 keys (all decoded; out of range past expert 8) and
# fetches the daemon must queue and serve, never reading a reply; then exits (the client "leaves").
FLOOD = r"""
import sys, time, zmq
from moestream.common import protocol as P
s = zmq.Context.instance().socket(zmq.DEALER)
for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)):
    s.setsockopt(opt, v)
s.connect(sys.argv[1])
s.send(P.Hello(P.PROTOCOL_VERSION, "flood").encode())
wide = [[0, e] for e in range(P.MAX_KEYS)]
valid = [[layer, e] for layer in range(2) for e in range(8)]
t_end, rid, sent = time.monotonic() + float(sys.argv[2]), 0, 0
while time.monotonic() < t_end:
    rid += 1
    try:
        s.send(P.Fetch(rid, wide if rid % 2 else valid).encode(), zmq.NOBLOCK)
        sent += 1
    except zmq.Again:
        time.sleep(0.001)
print(sent, flush=True)
"""


def test_a_client_that_floods_and_never_reads_is_bounded_by_bytes(tiny_model, start_daemon, wait_status):
    d = start_daemon(tiny_model, arena_slots=8)
    _baseline(d)
    # A first short flood pays the one-time costs (code paths, the allocator's first growth: they
    # measured 4-8 MiB and do not come again); what a flood leaves after that must be nothing.
    subprocess.run([sys.executable, "-c", FLOOD, d.endpoint, "1"], stdout=subprocess.DEVNULL, timeout=60)
    wait_status(d.status_endpoint, lambda s: not s["clients"], timeout_s=30)
    start = _baseline(d)
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, d.endpoint, "6"], stdout=subprocess.PIPE, text=True)
    peak = 0
    with IodClient(d.endpoint, name="other") as other:
        try:
            wait_status(d.status_endpoint, lambda s: any(c["name"] == "flood" for c in s["clients"]), timeout_s=30)
            while flood.poll() is None:
                peak = max(peak, _rss(d.pid)["VmRSS"])
                other.ping(30)  # the others are still answered meanwhile
                time.sleep(0.05)
            assert int(flood.communicate()[0]) > 1000
        finally:
            if flood.poll() is None:
                flood.kill()
                flood.communicate()
        assert peak - start < 64 * MiB, f"{peak / MiB:.0f} MiB during, {start / MiB:.0f} MiB before"
        s = wait_status(d.status_endpoint, lambda s: not any(c["name"] == "flood" for c in s["clients"]))
        assert s["clients_died"] == 2 and s["errors_by_code"].get("out_of_range", 0) > 0  # seen leaving
        other.ping(10)
    rss = _settled(d.pid, start)
    assert rss - start < 8 * MiB, f"{rss / MiB:.0f} MiB after, {start / MiB:.0f} MiB before"
