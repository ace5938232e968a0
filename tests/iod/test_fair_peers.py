"""Issue 22, item 1-2: a hog nobody can be starved by. Real daemons, a hostile peer made of raw
ZeroMQ DEALERs in its own process (it never releases and ignores recalls), and three real
`moestream generate` decoders that must finish with the `--resident` text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import pytest

from moestream.common.client import IodClient
from moestream.decoder import cli
from moestream.tools.spawn import spawn_daemon
from moestream.tools.status import get_status

PROMPT, N_NEW = "7,77,177,277,377", "6"
FAIR = ["--fair-by", "pid"]  # every process here runs as one uid: one share per process

# A peer that leases everything it can over `n` connections, never releases, keeps pinging (so no
# lease timeout saves anyone) and ignores `recall`. Prints "held N" once its fetches are answered.
HOG = r"""
import os, sys, time, zmq
from moestream.common import protocol as P
endpoint, n_conn, ask = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4:] == ["nobody"]:  # another user (root only): what the default, one share per uid, is for
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
ctx = zmq.Context()
socks = []
for i in range(n_conn):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(endpoint)
    s.send(P.Hello(P.PROTOCOL_VERSION, f"hog-{i}").encode())
    if not s.poll(20000):
        sys.exit("hog: no welcome")
    assert isinstance(P.decode_reply(s.recv()), P.Welcome)
    socks.append(s)
keys = [[0, e] for e in range(ask)]  # layer 0's experts: the others need free slots
per = -(-len(keys) // n_conn)
for i, s in enumerate(socks):
    if keys[i * per:(i + 1) * per]:
        s.send(P.Fetch(1, keys[i * per:(i + 1) * per]).encode())
held = answered = 0
counts = {"recall": 0, "revoked": 0}
poller = zmq.Poller()
for s in socks:
    poller.register(s, zmq.POLLIN)
last_ping, printed = time.monotonic(), False
while True:
    for s, _ in poller.poll(200):
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            m = P.decode_reply(s.recv())
            if isinstance(m, P.Ready):
                held += 1; answered += 1
            elif isinstance(m, P.Error) and m.rid == 1:
                answered += len(m.keys or [])
            elif isinstance(m, getattr(P, "Recall", ())):  # (an older daemon has none)
                counts["revoked" if m.revoked else "recall"] += len(m.leases)
                if m.revoked:
                    held -= len(m.leases)
    if not printed and answered >= len(keys):
        print("held", held, flush=True); printed = True
    if time.monotonic() - last_ping > 0.5:
        last_ping = time.monotonic()
        for s in socks:
            s.send(P.Ping(0).encode())
"""


@pytest.fixture(scope="module")
def resident_text(tiny_model):
    """What the resident decoder writes for the prompt: the reference every streamed decoder must match."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--model", str(tiny_model), "--resident", "--prompt-ids", PROMPT, "-n", N_NEW,
                         "--json", "--no-progress"]) == 0
    return json.loads(out.getvalue())


def _start_hog(endpoint: str, n_conn: int = 1, ask: int = 8, *as_user: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOG, endpoint, str(n_conn), str(ask), *as_user],
                            stdout=subprocess.PIPE, text=True)


def _held(hog: subprocess.Popen) -> int:
    line = hog.stdout.readline().split()
    assert line[:1] == ["held"], f"hog said {line}"
    return int(line[1])


def _decoders(model, endpoint: str, n: int = 3) -> list[subprocess.Popen]:
    args = [sys.executable, "-m", "moestream", "generate", "--model", str(model), "--iod", endpoint,
            "--prompt-ids", PROMPT, "-n", N_NEW, "--json", "--no-progress", "--stats"]
    return [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]


def _finish(decoders: list[subprocess.Popen], want: dict) -> list[str]:
    errs = []
    for p in decoders:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        got = json.loads(out)
        assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"]
        errs.append(err)
    return errs


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_hog_alone_first_gives_back_leases_when_decoders_join(tiny_model, start_daemon, resident_text, wait_status):
    d = start_daemon(tiny_model, arena_slots=8, extra_args=FAIR)
    hog = _start_hog(d.endpoint)
    decoders: list[subprocess.Popen] = []
    try:
        assert _held(hog) == 8  # alone: the whole arena (layer 1's experts now have no slot to go to)
        decoders = _decoders(tiny_model, d.endpoint)
        _finish(decoders, resident_text)
        s = get_status(d.status_endpoint)
        (h,) = [c for c in s["clients"] if c["name"] == "hog-0"]
        assert h["revoked"] >= 8 - s["fairness"]["client_lease_quota"], h  # it ignored the recall: taken back
        assert h["leases"] <= s["fairness"]["client_lease_quota"]
        assert s["fairness"]["client_lease_quota"] < s["arena"]["n_slots"]
        assert s["fairness"]["revoked_total"] == h["revoked"] and s["clients_died"] == 0
    finally:
        _stop(hog, *decoders)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the hog as another user")
def test_hog_of_another_user_under_the_default_fairness(tiny_model, resident_text):
    """The default shares by uid: a hog running as nobody (in the socket group) against root's decoders."""
    import grp

    d = spawn_daemon(tiny_model, arena_slots=8, extra_args=["--socket-group", grp.getgrgid(65534).gr_name])
    os.chmod(d.run_dir, 0o711)  # (a fresh temp dir: nobody may pass through it to the sockets)
    hog = _start_hog(d.endpoint, 2, 8, "nobody")  # two connections, too
    decoders: list[subprocess.Popen] = []
    try:
        assert _held(hog) == 8
        decoders = _decoders(tiny_model, d.endpoint)
        _finish(decoders, resident_text)
        s = get_status(d.status_endpoint)
        hogs = [c for c in s["clients"] if c["name"].startswith("hog-")]
        assert {c["share"] for c in hogs} == {"uid 65534"} and sum(c["revoked"] for c in hogs) > 0, hogs
    finally:
        _stop(hog, *decoders)
        d.stop()


def test_two_connection_hog_gets_one_share(tiny_model, start_daemon, resident_text, wait_status):
    d = start_daemon(tiny_model, arena_slots=8, extra_args=FAIR)
    hog = None
    decoders: list[subprocess.Popen] = []
    with IodClient(d.endpoint, name="bystander") as bystander:  # a second share from the start
        bystander.ping()
        try:
            hog = _start_hog(d.endpoint, n_conn=2)
            quota = get_status(d.status_endpoint)["fairness"]["client_lease_quota"]
            s = wait_status(d.status_endpoint, lambda s: sum(c["leases"] + c["parked"] for c in s["clients"]) >= 8)
            hogs = [c for c in s["clients"] if c["name"].startswith("hog-")]
            assert len(hogs) == 2 and sum(c["leases"] for c in hogs) <= quota, hogs
            assert len({c["share"] for c in hogs}) == 1  # two connections, one share
            decoders = _decoders(tiny_model, d.endpoint)
            _finish(decoders, resident_text)
        finally:
            _stop(*(p for p in (hog, *decoders) if p is not None))


def test_sigkilled_holder_frees_its_leases_at_once(tiny_model, start_daemon, resident_text, wait_status):
    d = start_daemon(tiny_model, arena_slots=8, extra_args=FAIR)  # default lease timeout: 30 s
    hog = _start_hog(d.endpoint)
    decoders: list[subprocess.Popen] = []
    try:
        assert _held(hog) == 8
        hog.kill()
        decoders = _decoders(tiny_model, d.endpoint)
        _finish(decoders, resident_text)
        s = get_status(d.status_endpoint)  # seen dead, not freed by its 30 s lease timeout
        assert s["clients_died"] == 1 and s["clients_expired"] == 0 and s["errors_by_code"].get("deadline", 0) == 0, s["errors_by_code"]
    finally:
        _stop(hog, *decoders)
