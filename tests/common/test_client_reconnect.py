"""The client against real daemon processes that are killed, stopped and restarted (issue 12, item 8).

A request is made outstanding for sure by freezing the daemon (SIGSTOP) before sending it;
the daemon is then SIGKILLed (or SIGTERMed) and a new one started on the same endpoint.
Bytes are checked against the file itself, not against an earlier run.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from moestream.common.client import (
    FingerprintMismatch,
    IodClient,
    IodUnavailable,
    LeaseVoided,
    State,
    fingerprint_mismatch,
)
from moestream.common.layout import ModelLayout
from moestream.tools.spawn import spawn_daemon
from moestream.tools.status import get_status


@pytest.fixture
def daemons(tmp_path: Path):
    """`daemons.start(model)` starts a daemon on tmp_path/run (the same endpoint every time);
    every daemon started is stopped after the test."""

    class Daemons:
        run_dir = tmp_path / "run"
        started: list = []

        def start(self, model: Path, **kwargs):
            d = spawn_daemon(model, run_dir=self.run_dir, arena_slots=8, **kwargs)
            self.started.append(d)
            return d

    ds = Daemons()
    yield ds
    for d in ds.started:
        if d.alive():
            os.kill(d.pid, signal.SIGCONT)
        d.stop()


def expert_bytes(model: Path, layer: int, expert: int) -> dict[str, bytes]:
    raw = model.read_bytes()
    return {p.name: raw[p.offset:p.offset + p.nbytes] for p in ModelLayout(model).experts.parts(layer, expert)}


def served_bytes(c: IodClient, lease) -> dict[str, bytes]:
    return {name: bytes(c.part_view(lease, name)) for name in lease.parts}


def kill_with_outstanding(c: IodClient, d, keys: list[tuple[int, int]]) -> list[cf.Future]:
    """Freeze `d`, fetch `keys` (they cannot be answered), then SIGKILL it."""
    os.kill(d.pid, signal.SIGSTOP)
    pending = c.fetch(keys)
    time.sleep(0.1)  # the fetch reaches the frozen daemon's socket
    d.proc.kill()
    d.proc.wait()
    return pending


def wait_state(c: IodClient, state: State, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while c.state is not state:
        assert time.monotonic() < deadline, f"client stayed {c.state}, expected {state}"
        time.sleep(0.01)


def test_killed_daemon_restarted_requests_resent_leases_voided(tiny_model, daemons):
    d1 = daemons.start(tiny_model)
    fp = ModelLayout(tiny_model).fingerprint.as_dict()
    with IodClient(d1.endpoint, expect_fingerprint=fp, reconnect_s=20) as c:
        old = c.fetch([(0, 0)])[0].result(10)
        old_arena = c.welcome["arena_name"]
        assert served_bytes(c, old) == expert_bytes(tiny_model, 0, 0)
        pending = kill_with_outstanding(c, d1, [(1, 3), (0, 5)])
        wait_state(c, State.RECONNECTING)
        assert not any(f.done() for f in pending)  # kept, not failed
        assert c.voided(old)
        with pytest.raises(LeaseVoided):
            c.part_view(old, "down")
        c.release(old)  # void: a no-op, nothing sent to the new daemon
        d2 = daemons.start(tiny_model)
        leases = [f.result(15) for f in pending]
        assert c.state is State.CONNECTED and c.reconnects == 1 and c.welcome["arena_name"] != old_arena
        for lease in leases:
            assert not c.voided(lease)
            assert served_bytes(c, lease) == expert_bytes(tiny_model, lease.layer, lease.expert)
        c.release_many(leases)
        c.ping()
        assert get_status(d2.status_endpoint)["requests"] == 2  # what was outstanding, sent once
    s = get_status(d2.status_endpoint)
    assert s["arena"]["leases"] == 0  # every lease went back, none was leaked by the restart


def test_sigterm_restart_is_survived(tiny_model, daemons):
    d1 = daemons.start(tiny_model)
    with IodClient(d1.endpoint, reconnect_s=20) as c:
        old = c.fetch([(0, 1)])[0].result(10)
        assert d1.stop() == 0  # `shutting_down`, then the connection drops
        wait_state(c, State.RECONNECTING)
        pending = c.fetch([(0, 1)])  # made while reconnecting: sent once the daemon is back
        daemons.start(tiny_model)
        lease = pending[0].result(15)
        assert c.voided(old) and not c.voided(lease)
        assert served_bytes(c, lease) == expert_bytes(tiny_model, 0, 1)
        c.release(lease)


def test_gives_up_after_the_reconnect_wait(tiny_model, daemons):
    d1 = daemons.start(tiny_model)
    c = IodClient(d1.endpoint, reconnect_s=0.5)
    try:
        pending = kill_with_outstanding(c, d1, [(0, 2)])
        t0 = time.monotonic()
        with pytest.raises(IodUnavailable, match=r"did not come back within 0.5s"):
            pending[0].result(10)
        assert time.monotonic() - t0 < 3.0  # bounded: the wait plus one poll period, not the fetch timeout
        assert c.state is State.DEAD
        with pytest.raises(IodUnavailable, match="did not come back"):  # dead is final
            c.fetch([(0, 3)])[0].result(5)
    finally:
        c.close()
        for p in Path("/dev/shm").glob(f"moestream-{d1.pid}-*"):  # SIGKILLed, no daemon came after it
            p.unlink(missing_ok=True)


def test_restarted_with_another_model_is_refused(tiny_model, make_tiny_model, daemons):
    other = make_tiny_model(arch="qwen3moe", quant="Q8_0", seed=1)  # same shapes, other weights
    d1 = daemons.start(tiny_model)
    c = IodClient(d1.endpoint, expect_fingerprint=ModelLayout(tiny_model).fingerprint.as_dict(), reconnect_s=20)
    try:
        pending = kill_with_outstanding(c, d1, [(0, 4)])
        daemons.start(other)
        with pytest.raises(FingerprintMismatch, match="data sample"):
            pending[0].result(15)
        assert c.state is State.DEAD
    finally:
        c.close()


def test_many_threads_share_one_client(tiny_model, daemons):
    """Threads fetch and release concurrently; every request is answered and every lease goes back."""
    d = daemons.start(tiny_model)
    errors: list[BaseException] = []
    want = {(layer, e): expert_bytes(tiny_model, layer, e) for layer in range(2) for e in range(8)}
    with IodClient(d.endpoint) as c:
        def work(seed: int) -> None:
            try:
                for i in range(40):
                    key = ((seed + i) % 2, (seed * 3 + i) % 8)
                    lease = c.fetch([key])[0].result(10)
                    assert served_bytes(c, lease) == want[key]
                    c.release(lease)
                    assert c.ping(5) >= 0
            except BaseException as e:  # noqa: BLE001 — reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
    s = get_status(d.status_endpoint)
    assert s["requests"] == 160 and s["arena"]["leases"] == 0


def test_fingerprint_mismatch_names_what_differs():
    base = {"path": "/a.gguf", "size": 100, "mtime_ns": 1, "header_sha256": "h" * 64, "sample_sha256": "s" * 64}
    assert fingerprint_mismatch(base, dict(base, path="/b.gguf", mtime_ns=2)) is None  # a copy, a touch
    msg = fingerprint_mismatch(base, dict(base, sample_sha256="t" * 64))
    assert "tensor data sample differs" in msg and "other weights" in msg and "table" not in msg
    msg = fingerprint_mismatch(base, dict(base, size=101, header_sha256="g" * 64))
    assert "file size differs (size 100 here, 101" in msg and "header/tensor table differs" in msg
    old = {k: v for k, v in base.items() if k != "sample_sha256"}  # a daemon from before content identity
    assert "not reported by the daemon (an older moestream-iod?)" in fingerprint_mismatch(base, old)


def test_a_client_that_only_reports_hits_stays_connected(tiny_model, start_daemon):
    """Touches get no answer: a client sending only those (every expert found in the arena) must
    still ping, or the daemon's silence reads as a lost daemon."""
    d = start_daemon(tiny_model, arena_slots=8, extra_args=["--lease-timeout", "0.4"])  # heartbeat 0.1 s
    with IodClient(d.endpoint, timeout_s=0.4) as c:
        c.release(c.fetch([(0, 1)])[0].result(10))
        end = time.monotonic() + 2.0  # 5x the client's silence limit
        while time.monotonic() < end:
            c.touch(0, [1])
            time.sleep(0.01)
        assert c.state is State.CONNECTED and c.reconnects == 0
