"""One daemon, many users (issue 12): what one peer, careless or hostile, must not be able to do.

Every test runs a real daemon process and talks to it over its real sockets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import zmq

from moestream.common import protocol as P
from moestream.common.client import IodClient, IodRequestError, IodUnavailable
from moestream.tools.spawn import spawn_daemon
from moestream.tools.status import format_status, get_status

IOD = [sys.executable, "-m", "moestream.iod.main"]


def _run_iod(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*IOD, *args], capture_output=True, text=True, timeout=timeout)


def _dealer(endpoint: str, **opts: int) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        s.setsockopt(getattr(zmq, k), v)
    s.connect(endpoint)
    return s


def _reply(s: zmq.Socket, timeout_s: float = 10) -> P.Message:
    assert s.poll(int(timeout_s * 1000)), "no reply"
    return P.decode_reply(s.recv())


def _memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}


def _config(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / f"iod-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(text)
    return ["--config", str(path)]


# -- item 6: an endpoint naming a regular file ----------------------------------------------
def test_endpoint_naming_a_regular_file_is_refused_and_left_alone(tiny_model, tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    out = _run_iod("--model", str(tiny_model), "--arena-slots", "2", "--endpoint", f"ipc://{victim}",
                   "--status-endpoint", f"ipc://{tmp_path}/status.sock")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a regular file, not a socket" in lines[0] and str(victim) in lines[0], lines
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "status.sock").exists()


# -- item 5: abstract sockets ---------------------------------------------------------------
def test_abstract_endpoint_refused_unless_allowed(tiny_model, tmp_path):
    abstract = f"ipc://@moestream-test-{uuid.uuid4().hex}"
    out = _run_iod("--model", str(tiny_model), "--arena-slots", "2", "--endpoint", abstract,
                   "--status-endpoint", f"ipc://{tmp_path}/status.sock")
    assert out.returncode == 2
    assert "abstract socket" in out.stderr and "no file" in out.stderr and "--allow-abstract" in out.stderr
    with spawn_daemon(tiny_model, run_dir=tmp_path / "run", arena_slots=2,
                      extra_args=["--endpoint", abstract, "--allow-abstract"]) as d:
        with IodClient(abstract, name="abstract-ok") as c:
            c.ping()
        assert get_status(d.status_endpoint)["endpoint"] == abstract


# -- item 7: client names -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ok\nmoestream-iod: INFO forged line", "\x1b[2J\x07", "x" * (P.MAX_NAME + 1), 5,
                                  "nul\x00", "line\u2028sep"])
def test_bad_client_names_are_refused_at_hello(tiny_model, start_daemon, name):
    d = start_daemon(tiny_model, arena_slots=2)
    s = _dealer(d.endpoint)
    try:
        s.send(P.Hello(P.PROTOCOL_VERSION, name).encode())
        msg = _reply(s)
        assert isinstance(msg, P.Error) and msg.code == "bad_message", msg
        assert "\n" not in msg.message and "\x1b" not in msg.message
        assert get_status(d.status_endpoint)["clients"] == []
    finally:
        s.close()


def test_names_are_escaped_in_status(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=2)
    with IodClient(d.endpoint, name="tab\there é✓") as c:  # the client escapes what it would be refused for
        c.ping()
        s = get_status(d.status_endpoint)
        assert [x["name"] for x in s["clients"]] == ["tab\\there é✓"]
    # an older daemon (or anything answering on the status socket) may send anything: the table escapes it
    s["clients"][0]["name"] = "evil\nforged\x1b[31m\x07"
    table = format_status(s)
    assert "\x1b" not in table and "\x07" not in table and "forged" not in table.split("\n")[-1][:3]
    assert "evil\\nforged\\x1b[" in table


# -- item 3: bounded memory per message and per client --------------------------------------
def test_huge_multipart_message_is_dropped_without_buffering(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=2)
    before = _memory_kib(d.pid)
    s = _dealer(d.endpoint, SNDHWM=0)
    try:
        big = b"\x00" * (15 << 20)
        s.send_multipart([big] * 40)  # 600 MiB in one message (each frame under the old 16 MiB limit)
        s.send(P.Ping(7.0).encode())  # after it: answered once the daemon has dealt with the big one
        deadline = time.monotonic() + 20
        while True:
            msg = _reply(s, max(0.1, deadline - time.monotonic()))
            if isinstance(msg, P.Pong):
                break
        after = _memory_kib(d.pid)
        grew_mib = (after["VmHWM"] - before["VmHWM"]) / 1024
        assert grew_mib < 64, f"daemon peak memory grew by {grew_mib:.0f} MiB ({before} -> {after})"
        # many small frames: read one at a time, dropped, one error; too big in total: too_large
        s.send_multipart([b"x" * 1000] * 40)
        msg = _reply(s)
        assert isinstance(msg, P.Error) and msg.code == "bad_message" and "41 frames" in msg.message, msg
        s.send(b"\x00" * (P.MAX_FRAME_BYTES + 4096))
        msg = _reply(s)
        assert isinstance(msg, P.Error) and msg.code == "too_large", msg
        with IodClient(d.endpoint) as c:
            c.release(c.fetch([(0, 0)])[0].result(10))
    finally:
        s.close()


def test_outstanding_requests_per_client_are_capped(tiny_model, start_daemon, tmp_path, wait_status):
    # no lease quota (share 1): the point here is the cap on requests, which a quota would pre-empt
    d = start_daemon(tiny_model, arena_slots=4, extra_args=_config(tmp_path, "max_queued_per_client = 8\n"
                                                                   "client_lease_share = 1.0\n"))
    with IodClient(d.endpoint, name="greedy") as c, IodClient(d.endpoint, name="other") as other:
        held = [f.result(10) for f in c.fetch([(0, e) for e in range(4)])]  # the arena is now all leased
        waiting = c.fetch([(1, e) for e in range(6)])  # queued: no slot can be freed
        wait_status(d.status_endpoint, lambda s: any(x["outstanding"] == 6 for x in s["clients"]))
        refused = c.fetch([(0, 4), (0, 5), (0, 6)])
        for f in refused:
            with pytest.raises(IodRequestError, match="busy") as e:
                f.result(10)
        assert "limit of 8" in e.value.message
        assert not any(f.done() for f in waiting)
        other_waiting = other.fetch([(1, e) for e in range(8)])  # the limit is per client
        for client, futures in ((c, waiting), (other, other_waiting)):
            for f in futures:  # each lease back as it comes: 4 slots serve 14 requests
                f.add_done_callback(lambda f, client=client: client.release(f.result()))
        for lease in held:
            c.release(lease)
        for f in [*waiting, *other_waiting]:
            f.result(10)
        s = get_status(d.status_endpoint)
        assert s["client_busy"] == 1 and s["errors_by_code"] == {"busy": 1}
        assert [x["outstanding"] for x in s["clients"]] == [0, 0]


# -- item 2: fairness between clients -------------------------------------------------------
def test_greedy_client_cannot_starve_another(tiny_model, start_daemon, tmp_path, wait_status):
    """A client that asks for the whole arena and keeps pinging gets its quota (half the slots)
    and a `deadline` error for the rest; another client's fetch still completes."""
    # both clients live in this process: one share each only with fairness by connection
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--queue-deadline", "1", "--fair-by", "connection"])
    with IodClient(d.endpoint, name="greedy") as greedy, IodClient(d.endpoint, name="other") as other:
        asked = greedy.fetch([(0, e) for e in range(4)])
        held = [f.result(10) for f in asked[:2]]  # quota: max(top-k 2, half of 4 slots) = 2
        s = wait_status(d.status_endpoint, lambda s: s["fairness"]["parked"] == 2)
        assert s["fairness"]["client_lease_quota"] == 2 and s["fairness"]["queue_deadline_s"] == 1.0
        got = [f.result(5) for f in other.fetch([(1, 0), (1, 1)])]  # never behind the greedy one
        for f in asked[2:]:  # the greedy one's extra requests end within the deadline, saying why
            with pytest.raises(IodRequestError) as e:
                f.result(5)
            assert e.value.code == P.ErrorCode.DEADLINE.value
            assert "quota is 2 of the arena's 4 slots" in e.value.message and "holds 2 leases" in e.value.message
        greedy.ping()  # still a live client with live leases
        for lease in held:
            greedy.release(lease)
        other.release_many(got)
        again = greedy.fetch([(0, 2)])[0].result(5)  # room again once its own leases went back
        greedy.release(again)
        s = wait_status(d.status_endpoint, lambda s: s["arena"]["leases"] == 0)
    assert s["errors_by_code"] == {"deadline": 2} and s["fairness"]["deadline_total"] == 2
    assert [(x["name"], x["parked"], x["outstanding"]) for x in s["clients"]] == [("greedy", 0, 0), ("other", 0, 0)]


def test_full_arena_answers_deadline_naming_the_holders(tiny_model, start_daemon):
    """Two clients each hold their quota of a 4-slot arena: a third one's fetch gets `deadline`
    within the deadline (not an endless wait), and the message says who holds the slots."""
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--queue-deadline", "1"])
    with IodClient(d.endpoint, name="a") as a, IodClient(d.endpoint, name="b") as b, \
            IodClient(d.endpoint, name="c") as c:
        held_a = [f.result(10) for f in a.fetch([(0, 0), (0, 1)])]
        held_b = [f.result(10) for f in b.fetch([(0, 2), (0, 3)])]
        t0 = time.monotonic()
        with pytest.raises(IodRequestError) as e:
            c.fetch([(1, 0)])[0].result(10)
        waited = time.monotonic() - t0
        assert e.value.code == "deadline" and 1.0 <= waited < 6.0, (e.value, waited)  # not for ever
        assert "no arena slot free for" in e.value.message and "'a' 2" in e.value.message and "'b' 2" in e.value.message
        a.release_many(held_a)
        c.release(c.fetch([(1, 0)])[0].result(5))  # served once a slot is free
        b.release_many(held_b)
    s = get_status(d.status_endpoint)
    assert s["queues"]["expired_deadline"] == 1 and s["errors_by_code"] == {"deadline": 1}


def test_now_never_waits_behind_another_clients_ahead_leases(tiny_model, start_daemon):
    """A prefetcher leasing every cached expert `ahead` is stopped at the demand reserve (2 of 8
    slots), so another client's `now` reads find a slot at once. The quota is off here (share 1):
    this is the reserve's doing alone."""
    d = start_daemon(tiny_model, arena_slots=8, extra_args=["--client-lease-share", "1"])
    with IodClient(d.endpoint, name="warm") as warm:  # layer 0 fills the arena, unleased
        warm.release_many([f.result(10) for f in warm.fetch([(0, e) for e in range(8)])])
    with IodClient(d.endpoint, name="prefetcher") as a, IodClient(d.endpoint, name="demand") as b:
        ahead = a.fetch([(0, e) for e in range(8)], priority="ahead")  # all hits
        leased = [f.result(10) for f in ahead[:6]]
        for f in ahead[6:]:
            with pytest.raises(IodRequestError) as e:
                f.result(10)
            assert e.value.code == "dropped" and "kept for demand" in e.value.message
        assert get_status(d.status_endpoint)["arena"]["leased_slots"] == 6
        got = [f.result(5) for f in b.fetch([(1, 0), (1, 1)])]  # two reads into the reserve
        b.release_many(got)
        a.release_many(leased)
    s = get_status(d.status_endpoint)
    assert s["queues"]["now_waited_slot"] == 0 and s["misses"] == 8 + 2


# -- item 4: replies dropped at the high-water mark -----------------------------------------
def test_client_that_never_reads_holds_no_lease_for_dropped_replies(tiny_model, start_daemon, tmp_path):
    d = start_daemon(tiny_model, arena_slots=16, extra_args=_config(tmp_path, "max_replies_queued = 1000\n"
                                                                    "client_lease_share = 1.0\n"))
    keys = [[layer, e] for layer in range(2) for e in range(8)]
    with IodClient(d.endpoint) as warm:  # every expert cached: each fetch is 16 immediate `ready`s
        for f in warm.fetch([tuple(k) for k in keys]):
            warm.release(f.result(10))
    s = _dealer(d.endpoint, RCVHWM=1, RCVBUF=4096, SNDHWM=0)
    try:
        s.send(P.Hello(P.PROTOCOL_VERSION, "never-reads").encode())
        assert isinstance(_reply(s), P.Welcome)
        n = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the daemon has had to drop replies
            for _ in range(100):
                n += 1
                s.send(P.Fetch(n, keys).encode())
            st = get_status(d.status_endpoint)
            if st["replies_dropped"]:
                break
        st = get_status(d.status_endpoint)
        (me,) = [x for x in st["clients"] if x["name"] == "never-reads"]
        assert me["replies_dropped"] > 0
        assert me["leases"] == me["readies"] == st["arena"]["leases"], "a lease without a delivered reply"
        got = 0
        while s.poll(500):
            if isinstance(P.decode_reply(s.recv()), P.Ready):
                got += 1
        st = get_status(d.status_endpoint)
        (me,) = [x for x in st["clients"] if x["name"] == "never-reads"]
        assert got == me["readies"] == me["leases"] == st["arena"]["leases"]
        assert me["readies"] + me["replies_dropped"] == me["requests"]
    finally:
        s.close()


# -- item 10: systemd fit -------------------------------------------------------------------
def test_sighup_is_logged_and_ignored(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=2)
    with IodClient(d.endpoint) as c:
        os.kill(d.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "SIGHUP ignored" not in d.log_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.alive() and "SIGHUP ignored" in d.log_text()
        c.release(c.fetch([(0, 1)])[0].result(10))
    assert d.stop() == 0


def test_version():
    out = _run_iod("--version")
    assert out.returncode == 0 and out.stdout.startswith("moestream-iod ") and out.stdout.split()[1][0].isdigit()


# -- item 11: errors that say what is wrong -------------------------------------------------
def test_client_pointed_at_status_socket_is_told_so(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=2)
    t0 = time.monotonic()
    with pytest.raises(IodUnavailable, match="status endpoint") as e:
        IodClient(d.status_endpoint, timeout_s=3)
    assert d.endpoint in str(e.value) and time.monotonic() - t0 < 2


def test_client_without_permission_is_told_so(tiny_model, start_daemon, tmp_path):
    d = start_daemon(tiny_model, arena_slots=2)
    # Root may open anything: there the client drops to nobody once imported (the interpreter may sit
    # where nobody cannot read it); otherwise the socket file loses its permissions.
    code = ("import os, sys\nfrom moestream.common.client import IodClient, IodUnavailable\n"
            "if os.geteuid() == 0:\n    os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
            "try:\n    IodClient(sys.argv[1], timeout_s=3)\nexcept IodUnavailable as e:\n    print(e)\n")
    if os.geteuid() != 0:
        os.chmod(d.endpoint[len("ipc://"):], 0)
    out = subprocess.run([sys.executable, "-c", code, d.endpoint], capture_output=True, text=True, timeout=30)
    assert "permission denied" in out.stdout and d.endpoint[len("ipc://"):] in out.stdout, out


def test_endpoint_that_is_not_a_socket_is_told_so(tmp_path):
    notsock = tmp_path / "plain"
    notsock.write_text("")
    t0 = time.monotonic()
    with pytest.raises(IodUnavailable, match="is not a socket"):
        get_status(f"ipc://{notsock}")
    with pytest.raises(IodUnavailable, match="is not a socket"):
        IodClient(f"ipc://{notsock}", timeout_s=3)
    with pytest.raises(IodUnavailable, match="no answer .* there is no socket at"):
        IodClient(f"ipc://{tmp_path}/missing.sock", timeout_s=0.3)
    assert time.monotonic() - t0 < 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the reader as a second uid in the group")
def test_a_group_member_can_read_the_arena_but_never_write_it(tiny_model, start_daemon):
    """Item 1: the arena is group read-only. A decoder in the socket group (here: nobody, in group
    nogroup) attaches it read-only and fetches, but cannot open it for writing."""
    import grp

    group = grp.getgrgid(65534).gr_name
    d = start_daemon(tiny_model, arena_slots=2, extra_args=["--socket-group", group])
    arena = next(p for p in os.listdir("/dev/shm") if p.startswith(f"moestream-{d.pid}-"))
    path = f"/dev/shm/{arena}"
    assert os.stat(path).st_mode & 0o777 == 0o640 and os.stat(path).st_gid == 65534
    code = ("import os, sys\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
            "try:\n    os.open(sys.argv[1], os.O_RDWR)\nexcept PermissionError:\n    print('no write')\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\nprint('read', len(os.read(fd, 16)))\n")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["no", "write", "read", "16"], out


def test_a_client_alone_may_use_the_whole_arena(tiny_model, start_daemon, wait_status):
    """The quota is for sharing: a decoder alone on the daemon (its prefetched leases held while
    its demand comes) gets every slot; a second client brings the share back."""
    d = start_daemon(tiny_model, arena_slots=4, extra_args=["--fair-by", "connection"])
    with IodClient(d.endpoint, name="alone") as alone:
        held = [f.result(5) for f in alone.fetch([(0, e) for e in range(4)])]  # quota would be 2
        with IodClient(d.endpoint, name="second") as second:
            alone.release_many(held[:2])
            more = alone.fetch([(1, 0)])  # 2 held + 1 > quota 2 while someone else is connected
            wait_status(d.status_endpoint, lambda s: s["fairness"]["parked"] == 1)
            second.ping()
        held = held[2:] + [more[0].result(5)]  # the second one left: room again
        alone.release_many(held)
