"""The client's side of recalls (iod/fairness.py), against a real daemon: leases held while alone
are asked back once another share connects; released in time they are simply gone, kept they
are revoked, and a revoked lease is void (never read, released as a no-op)."""

from __future__ import annotations

import time

import pytest

from moestream.common.client import IodClient, LeaseVoided
from moestream.tools.status import get_status

# both clients live in this process: one share each only with fairness by connection
ARGS = ["--fair-by", "connection", "--recall-grace", "1"]


def _wait_recalled(c: IodClient, n: int, timeout_s: float = 20.0) -> set:
    got: set = set()
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got |= c.take_recalled()
        time.sleep(0.02)
    return got


def test_recalled_leases_released_in_time_are_not_revoked(tiny_model, start_daemon, wait_status):
    d = start_daemon(tiny_model, arena_slots=8, extra_args=ARGS)
    with IodClient(d.endpoint, name="first") as first:
        held = [f.result(10) for f in first.fetch([(0, e) for e in range(8)])]  # alone: the whole arena
        with IodClient(d.endpoint, name="second") as second:
            quota = second.lease_quota
            recalled = _wait_recalled(first, 8 - quota)
            assert len(recalled) == 8 - quota, recalled  # the longest held, down to the quota
            back = [x for x in held if (x.slot, x.generation) in recalled]
            first.release_many(back)
            s = wait_status(d.status_endpoint, lambda s: s["arena"]["leases"] == quota)
            time.sleep(1.5)  # past the grace: nothing more is taken
            s = get_status(d.status_endpoint)
            assert s["fairness"]["revoked_total"] == 0 and s["arena"]["leases"] == quota
            second.release(second.fetch([(1, 0)])[0].result(10))
        first.release_many([x for x in held if x not in back])
        assert first.recalls == {"recalled": 8 - quota, "revoked": 0}


def test_recalled_leases_kept_are_revoked_and_void(tiny_model, start_daemon, wait_status):
    d = start_daemon(tiny_model, arena_slots=8, extra_args=ARGS)
    with IodClient(d.endpoint, name="keeper") as keeper:
        held = [f.result(10) for f in keeper.fetch([(0, e) for e in range(8)])]
        with IodClient(d.endpoint, name="second") as second:
            quota = second.lease_quota
            s = wait_status(d.status_endpoint, lambda s: s["fairness"]["revoked_total"] == 8 - quota)
            assert s["arena"]["leases"] == quota
            gone = [x for x in held if keeper.voided(x)]
            assert len(gone) == 8 - quota
            with pytest.raises(LeaseVoided):
                keeper.part_view(gone[0], next(iter(gone[0].parts)))
            got = [f.result(10) for f in second.fetch([(1, e) for e in range(8 - quota)])]  # the room it needed
            second.release_many(got)
        keeper.release_many(held)  # the revoked ones are skipped: no `not_leased` error
        s = wait_status(d.status_endpoint, lambda s: s["arena"]["leases"] == 0)
    assert s["errors_by_code"].get("not_leased", 0) == 0
    assert keeper.recalls["revoked"] == 8 - quota


def test_a_demand_waiting_on_a_full_arena_is_served_in_bounded_time(tiny_model, start_daemon, wait_status):
    """Two shares fill the arena within their quotas and keep it; a third share's fetch is not left
    to its `deadline`: the others are recalled down to a fair share and what they keep is revoked."""
    d = start_daemon(tiny_model, arena_slots=8, extra_args=ARGS)
    with IodClient(d.endpoint, name="a") as a, IodClient(d.endpoint, name="b") as b, \
            IodClient(d.endpoint, name="c") as c:
        held_a = [f.result(10) for f in a.fetch([(0, e) for e in range(4)])]
        held_b = [f.result(10) for f in b.fetch([(0, e) for e in range(4, 8)])]
        assert get_status(d.status_endpoint)["arena"]["free_slots"] == 0
        got = c.fetch([(1, 0)])[0].result(30)  # the daemon's queue deadline is 5 s: served, not `deadline`
        s = get_status(d.status_endpoint)
        assert s["errors_by_code"].get("deadline", 0) == 0 and s["fairness"]["revoked_total"] > 0
        assert s["fairness"]["fair_share"] == 2  # max(top-k 2, 8 slots // 3 shares)
        c.release(got)
        a.release_many(held_a)
        b.release_many(held_b)
