"""moestream-iod under bad input: malformed messages, bad model files, bad configs."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

from moestream.common import protocol as P
from moestream.common.client import IodClient
from moestream.tools.spawn import DaemonStartError, spawn_daemon
from moestream.tools.status import get_status

SHM = Path("/dev/shm")


def _malformed(i: int, rng: random.Random, good_slot: int) -> tuple[list[bytes], str]:
    """The i-th bad message (frames) and the error code it must get back."""
    pack = lambda m: msgpack.packb(m, use_bin_type=True)  # noqa: E731
    kinds = [
        (lambda: [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40))) + b"\xc1"], "bad_msgpack"),
        (lambda: [pack([1, 2, 3])], "bad_msgpack"),
        (lambda: [pack({"op": "explode"})], "unknown_op"),
        (lambda: [pack({"op": 7})], "unknown_op"),
        (lambda: [pack({"op": "fetch", "rid": "x", "keys": [[0, 0]]})], "bad_message"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[0, "a"]]})], "bad_message"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[0, 0]], "priority": "urgent"})], "bad_message"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": []})], "bad_message"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[0, 0], [0, 0]]})], "bad_message"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[0, 0, 0]]})], "bad_message"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[rng.randint(2, 10**6), 0]]})], "out_of_range"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[0, rng.randint(8, 10**6)]]})], "out_of_range"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[-1, 0]]})], "bad_message"),
        (lambda: [pack({"op": "fetch", "rid": i, "keys": [[0, e] for e in range(P.MAX_KEYS + 1)]})], "too_large"),
        (lambda: [b"\x00" * (P.MAX_FRAME_BYTES + 1)], "too_large"),
        (lambda: [pack({"op": "release", "slot": good_slot, "generation": 10**9})], "not_leased"),
        (lambda: [pack({"op": "release", "slot": 10**6, "generation": 1})], "not_leased"),
        (lambda: [pack({"op": "release", "slot": True, "generation": 1})], "bad_message"),
        (lambda: [pack({"op": "hello", "version": 999})], "bad_version"),
        (lambda: [pack({"op": "cancel", "rid": None})], "bad_message"),
        (lambda: [pack({"op": "ping"}), b"extra"], "bad_message"),
        (lambda: [pack({1: 2})], "bad_msgpack"),
        (lambda: [pack({"op": "ping"})] + [b"x" * 100] * rng.randint(2, 60), "bad_message"),  # many frames
        (lambda: [b"\x00" * (P.MAX_FRAME_BYTES + 2048)], "too_large"),  # over the total: dropped unparsed
        (lambda: [pack({"op": "hello", "version": P.PROTOCOL_VERSION, "name": "a\nb"})], "bad_message"),
    ]
    make, code = kinds[i % len(kinds)]
    return make(), code


def test_1000_malformed_messages_each_get_an_error(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=4)
    good = IodClient(d.endpoint, name="good")
    ctx = zmq.Context.instance()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    try:
        bad.connect(d.endpoint)
        bad.send(P.Hello(P.PROTOCOL_VERSION, "evil").encode())
        welcome = P.decode_reply(bad.recv())
        assert isinstance(welcome, P.Welcome)
        lease = good.fetch([(0, 0)])[0].result(10)  # a slot leased by someone else
        rng = random.Random(0)
        expected = []
        for i in range(1000):
            frames, code = _malformed(i, rng, lease.slot)
            bad.send_multipart(frames)
            expected.append(code)
            if i % 100 == 99:  # the good client keeps being served throughout
                x = good.fetch([(1, i // 100 % 8)])[0].result(10)
                good.release(x)
        got = []
        for _ in expected:
            assert bad.poll(10000), f"only {len(got)} replies"
            msg = P.decode_reply(bad.recv())
            assert isinstance(msg, P.Error), msg
            got.append(msg.code)
        assert got == expected
        assert good.ping() < 5
        good.release(lease)
        good.ping()  # after the release on the same connection: the daemon has handled it
        s = get_status(d.status_endpoint)
        assert s["errors"] == 1000 and s["errors_by_code"].get("internal", 0) == 0
        assert s["arena"]["leases"] == 0
    finally:
        bad.close()
        good.close()


def test_requests_before_hello_get_no_hello(tiny_model, start_daemon):
    d = start_daemon(tiny_model, arena_slots=2)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(d.endpoint)
        s.send(P.Fetch(5, [[0, 0]]).encode())
        assert s.poll(10000)
        msg = P.decode_reply(s.recv())
        assert isinstance(msg, P.Error) and msg.code == "no_hello" and msg.rid == 5
        s.send(P.Ping(1.5).encode())  # ping needs no hello
        assert s.poll(10000)
        assert P.decode_reply(s.recv()) == P.Pong(1.5)
    finally:
        s.close()


def _arenas_of(pid: int) -> list[str]:
    return [p.name for p in SHM.iterdir() if p.name.startswith(f"moestream-{pid}-")]


def _assert_fails_cleanly(model: Path, tmp_path: Path, match: str) -> None:
    with pytest.raises(DaemonStartError, match=match) as e:
        spawn_daemon(model, run_dir=tmp_path / "run", arena_slots=2, ready_timeout_s=20)
    assert "code 2" in str(e.value)  # a configuration error: systemd must not restart it
    assert e.value.pid and not _arenas_of(e.value.pid)
    assert not (tmp_path / "run" / "iod.sock").exists()


def test_bad_model_exits_nonzero_without_leftovers(tiny_model, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(1000))
    _assert_fails_cleanly(junk, tmp_path, "not a GGUF file")
    truncated = tmp_path / "trunc.gguf"
    data = tiny_model.read_bytes()
    truncated.write_bytes(data[: len(data) - 5000])
    _assert_fails_cleanly(truncated, tmp_path, "truncated")
    _assert_fails_cleanly(tmp_path / "missing.gguf", tmp_path, "no such file")


def test_one_clear_line_on_fatal_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "moestream.iod.main", "--model", str(tmp_path / "nope.gguf"),
                          "--endpoint", f"ipc://{tmp_path}/a.sock", "--status-endpoint", f"ipc://{tmp_path}/s.sock"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"moestream-iod: error: model {tmp_path / 'nope.gguf'}: no such file"]


def test_bad_config_exits_2(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, "-m", "moestream.iod.main", "--model", str(tiny_model),
                          "--arena-bytes", "lots"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bad size 'lots'" in out.stderr


def test_second_daemon_on_same_endpoint_refused(tiny_model, start_daemon, tmp_path):
    d = start_daemon(tiny_model, arena_slots=2)
    ep = ["--endpoint", d.endpoint, "--status-endpoint", f"ipc://{tmp_path}/other.sock"]
    p = subprocess.Popen([sys.executable, "-m", "moestream.iod.main", "--model", str(tiny_model), "--arena-slots", "2", *ep],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "another daemon is listening" in err
    # refused before creating anything: no arena, and no status socket was made
    assert not _arenas_of(p.pid)
    assert not (tmp_path / "other.sock").exists()
    assert get_status(d.status_endpoint)["pid"] == d.pid  # the first one is untouched
    with IodClient(d.endpoint) as c:
        c.ping()


def test_stale_socket_file_is_replaced(tiny_model, tmp_path):
    import socket

    run = tmp_path / "run"
    run.mkdir()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(run / "iod.sock"))  # bound, never listening: what a crashed daemon leaves
    s.close()
    with spawn_daemon(tiny_model, run_dir=run, arena_slots=2) as d:
        with IodClient(d.endpoint) as c:
            c.ping()
    assert not (run / "iod.sock").exists()
    shutil.rmtree(run)
