"""Reads at full depth, demand before prefetch: the reader's queue, the depth gauge, and real daemons."""

from __future__ import annotations

import os
import time

import pytest
from moestream.common.client import IodClient
from moestream.common.layout import PAGE
from moestream.tools.status import get_status
from moestream.iod import readers
from moestream.iod.depth_gauge import DepthGauge, bucket
from moestream.iod.readers import PendingQueue, ReadOp


def chunks(q: PendingQueue, n: int, *, ahead: bool = False, first: int = 0) -> readers.Batch:
    """Queue `n` one-page chunks, two pages apart (never merged), as one batch."""
    batch = readers.Batch(n, lambda e: None, ahead)
    buf = memoryview(bytearray(n * PAGE))
    q.put([readers.Chunk(ReadOp((first + 2 * i) * PAGE, PAGE, buf[i * PAGE : (i + 1) * PAGE]), batch)
           for i in range(n)])
    return batch


def take_all(q: PendingQueue) -> list[readers.Run]:
    out = []
    while (run := q.take(block=False)) is not None:
        out.append(run)
    return out


def test_queue_keeps_depth_in_flight_and_refills_on_done():
    q = PendingQueue(depth=32)
    chunks(q, 120)
    runs = take_all(q)
    assert len(runs) == 32 and q.flight_stats()["in_flight"] == q.flight_stats()["peak"] == 32
    q.done(runs[0])
    assert len(take_all(q)) == 1  # one place freed, one more read starts


def test_demand_chunks_go_first_and_prefetch_keeps_out_of_the_reserve():
    q = PendingQueue(depth=4, ahead_depth=3)
    chunks(q, 10, ahead=True)
    chunks(q, 1, first=100)
    runs = take_all(q)
    assert [r.ahead for r in runs] == [False, True, True, True]  # demand first, then prefetch up to 3
    q.done(runs[1])
    assert [r.ahead for r in take_all(q)] == [True]
    q.done(runs[0])
    assert take_all(q) == []  # the freed demand place is not for prefetches
    chunks(q, 1, first=200)
    assert [r.ahead for r in take_all(q)] == [False]


def test_promote_moves_a_prefetch_ahead_of_other_prefetches():
    q = PendingQueue(depth=2, ahead_depth=1)
    chunks(q, 3, ahead=True)
    late = chunks(q, 2, ahead=True, first=100)
    assert [r[0].offset for r in take_all(q)] == [0]  # the prefetch share (1) is used up
    q.promote(late)
    got = take_all(q)
    assert [(r[0].offset, r.ahead) for r in got] == [(100 * PAGE, False)]  # now demand: it may start
    assert not late.ahead


def test_gauge_time_weighted_mean_and_histogram():
    t = [0.0]
    g = DepthGauge(clock=lambda: t[0])
    g.add()
    t[0] = 1.0
    g.add()
    t[0] = 3.0
    g.remove()
    t[0] = 4.0
    g.remove()
    t[0] = 10.0  # idle time does not count
    s = g.stats()
    assert s["peak"] == 2 and s["in_flight"] == 0 and s["busy_s"] == 4.0
    assert s["mean"] == 1.5 and s["hist"] == {"1": 0.5, "2-3": 0.5}
    assert [bucket(n) for n in (1, 2, 3, 4, 31, 32)] == ["1", "2-3", "2-3", "4-7", "16-31", "32-63"]


def test_readers_report_in_flight(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * PAGE))
    for backend in ("threads", "auto"):
        with readers.open_reader(path, backend=backend, depth=8, ahead_depth=6) as r:
            done = []
            buf = bytearray(16 * PAGE)
            for i in range(16):
                r.submit([ReadOp(2 * i * PAGE, PAGE, memoryview(buf)[i * PAGE : (i + 1) * PAGE])], done.append,
                         ahead=i % 2 == 0)
            deadline = time.monotonic() + 5
            while len(done) < 16 and time.monotonic() < deadline:
                time.sleep(0.005)
            s = r.stats()
        assert done == [None] * 16
        assert s["ahead_depth"] == 6 and s["in_flight"]["in_flight"] == 0
        assert 1 <= s["in_flight"]["peak"] <= 8 and s["in_flight"]["issued"] == s["preadv_calls"] == 16


# -- real daemons -----------------------------------------------------------------------------
@pytest.fixture
def model40(make_tiny_model):
    return make_tiny_model(layers=2, experts=40)


def spread_keys(n: int) -> list[tuple[int, int]]:
    """`n` experts, no two neighbours in the file (so the count of reads is not blurred by merging)."""
    return [(e % 2, e // 2 * 2) for e in range(n)]


@pytest.mark.parametrize("backend", ["auto", "threads"])
@pytest.mark.parametrize("slots", [64, 20])
def test_forty_key_fetch_reads_at_full_depth(model40, start_daemon, backend, slots):
    """A 40-expert `now` batch starts min(32, free slots) reads at once; with fewer slots the rest
    follow as leases come back. (The reader's own peak is reported too, but a tiny file in the page
    cache is read faster than the loop submits, so only the expert loads are held to the number.)"""
    # one client: no per-client quota, so the depth is the reader's and the arena's, not the quota's
    d = start_daemon(model40, arena_slots=slots, extra_args=["--backend", backend, "--client-lease-share", "1"])
    with IodClient(d.endpoint) as c:
        futures = c.fetch(spread_keys(40))
        for f in futures:
            c.release(f.result(10))  # with 20 slots, releasing frees room for the rest
        s = get_status(d.status_endpoint)
    q, r = s["queues"], s["reader"]
    assert q["max_inflight"] == 32 and q["in_flight"]["peak"] == min(32, slots)
    assert q["in_flight"]["in_flight"] == 0 and q["in_flight"]["issued"] == 40
    assert q["now_waited_place"] + q["now_waited_slot"] >= 1  # 40 > what could start at once
    assert 1 <= r["in_flight"]["peak"] <= 32 and r["in_flight"]["issued"] == r["preadv_calls"]
    assert sum(r["in_flight"]["hist"].values()) == pytest.approx(1, abs=0.01)


@pytest.mark.parametrize("direct", [True, False])
def test_the_daemon_reads_as_configured(tiny_model, start_daemon, direct):
    """--queue-depth and --direct reach the reader the daemon runs (its live counters say so)."""
    flag = "--direct" if direct else "--no-direct"
    daemon = start_daemon(tiny_model, arena_slots=8, extra_args=["--queue-depth", "7", flag])
    reader = get_status(daemon.status_endpoint)["reader"]
    assert reader["depth"] == 7 and reader["direct"] is direct
