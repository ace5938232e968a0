"""Demand (`now`) before prefetch (`ahead`) with real daemons: read places, arena slots, stale drops."""

from __future__ import annotations

import time

import pytest
from moestream.common.client import IodClient
from moestream.tools.status import get_status


@pytest.fixture
def model40(make_tiny_model):
    return make_tiny_model(layers=2, experts=40)


def spread_keys(n: int) -> list[tuple[int, int]]:
    return [(e % 2, e // 2 * 2) for e in range(n)]


def test_now_never_waits_behind_ahead(model40, start_daemon):
    """40 prefetches take at most 24 of the 32 read places, so a demand read starts at once."""
    d = start_daemon(model40, arena_slots=80, extra_args=["--client-lease-share", "1"])  # one client, 41 requests
    with IodClient(d.endpoint) as c:
        ahead = c.fetch(spread_keys(40), priority="ahead")
        now = c.fetch([(0, 1)])
        c.release(now[0].result(10))
        for f in ahead:
            c.release(f.result(10))
        s = get_status(d.status_endpoint)
    q = s["queues"]
    assert q["ahead_max_inflight"] == 24 and s["reader"]["ahead_depth"] == 24
    assert q["peak_ahead"] == 24 and q["now_waited_place"] == 0
    assert q["reads_started_now"] == 1 and q["reads_started_ahead"] == 40


def test_prefetch_leases_leave_slots_for_demand(model40, start_daemon):
    """A client holding prefetched leases cannot take the reserved quarter of the arena."""
    # reserve: 2 slots; no per-client quota, so only the reserve holds the prefetcher back
    d = start_daemon(model40, arena_slots=8, extra_args=["--client-lease-share", "1"])
    with IodClient(d.endpoint, name="prefetcher") as a, IodClient(d.endpoint, name="demand") as b:
        ahead = a.fetch([(0, e) for e in range(8)], priority="ahead")
        held = [f.result(10) for f in ahead[:6]]
        time.sleep(0.1)
        assert not any(f.done() for f in ahead[6:])  # the last two wait: they would eat the reserve
        got = [f.result(5) for f in b.fetch([(1, 0), (1, 1)])]  # demand gets the reserve at once
        assert get_status(d.status_endpoint)["queues"]["now_waited_slot"] == 0
        for x in got:
            b.release(x)
        for x in held:
            a.release(x)
        for f in ahead[6:]:
            a.release(f.result(10))  # room again: the held-back prefetches run
    s = get_status(d.status_endpoint)
    assert s["queues"]["reserve_slots"] == 2 and s["queues"]["reads_started_ahead"] == 8


def test_now_joined_prefetch_is_not_dropped_as_stale(tiny_model, start_daemon, tmp_path):
    cfg = tmp_path / "iod.toml"
    cfg.write_text("ahead_max_age_s = 0.2\nlease_timeout = 1.0\nclient_lease_share = 1.0\n")  # the ticker runs every 0.25 s
    d = start_daemon(tiny_model, arena_slots=1, extra_args=["--config", str(cfg)])
    with IodClient(d.endpoint, name="a") as a, IodClient(d.endpoint, name="b") as b:
        held = a.fetch([(0, 0)])[0].result(10)  # the only slot: the prefetch below queues
        ahead = a.fetch([(1, 3)], priority="ahead")[0]
        now = b.fetch([(1, 3)])[0]  # joins the queued prefetch, which becomes demand
        time.sleep(0.6)  # stale age passed and the ticker ran
        assert not ahead.done() and not now.done()  # still queued, not dropped
        a.release(held)
        a.release(ahead.result(10))
        b.release(now.result(10))
    q = get_status(d.status_endpoint)["queues"]
    assert q["dropped"] == 0 and q["reads_started_now"] == 2 and q["reads_started_ahead"] == 0


def test_one_release_message_hands_back_many_leases(tiny_model, start_daemon):
    """`release_many`: a layer's leases go back in one message; a bad pair among them is refused
    (not_leased) while the good ones are still released."""
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--client-lease-share", "1"])  # one client, whole arena
    with IodClient(d.endpoint) as c:
        leases = [f.result(10) for f in c.fetch([(0, e) for e in range(4)])]
        assert get_status(d.status_endpoint)["arena"]["leased_slots"] == 4
        c.release_many(leases)
        c.ping()  # the release went out before the ping's answer came back
        st = get_status(d.status_endpoint)
        assert st["arena"]["leased_slots"] == 0 and st["releases"] == 4
        with pytest.raises(ValueError, match="is not held"):
            c.release_many(leases[:1])
