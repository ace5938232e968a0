"""Wire messages: round trips, and every kind of bad input maps to its error code."""

from __future__ import annotations

import msgpack
import pytest

from moestream.common import protocol as P


def pack(m) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


@pytest.mark.parametrize("msg", [
    P.Hello(P.PROTOCOL_VERSION, "dec", 42),
    P.Fetch(7, [[0, 1], [3, 2]], "ahead"),
    P.Release(3, 9),
    P.Cancel(7), P.Cancel(7, [[1, 2]]),
    P.Ping(1.25), P.Bye(), P.Status(), P.Touch([[0, 1], [2, 3]], [1, 7]),
    P.Fetch(7, [[0, 1], [3, 2]], "now", [5, 1]), P.Touch([[0, 1], [2, 3]], [1, 7], [4, 7]),
])
def test_requests_round_trip(msg):
    got = P.decode_request(msg.encode())
    assert type(got) is type(msg)
    if isinstance(msg, P.Touch):
        assert got.keys == [(0, 1), (2, 3)] and got.counts == [1, 7] and got.uses == msg.uses
    elif isinstance(msg, P.Fetch):
        assert got.keys == [tuple(k) for k in msg.keys] and got.rid == 7 and got.priority == msg.priority
        assert got.uses == msg.uses
    elif isinstance(msg, P.Cancel):
        assert got.rid == 7 and got.keys == (None if msg.keys is None else [(1, 2)])
    else:
        assert got == msg


@pytest.mark.parametrize("msg", [
    P.Welcome(1, {"size": 1}, "moestream-1-" + "0" * 32, 4, 8192, {"n_layer": 2}, 1.0, 4.0),
    P.Ready(1, 0, 3, 2, 5, {"gate": [0, 100], "up": [4096, 100]}),
    P.Error("busy", "queue full", 3, [[0, 1]]), P.Error("not_leased", "x"),
    P.Pong(2.5), P.StatusReply({"uptime_s": 1.0}),
])
def test_replies_round_trip(msg):
    assert P.decode_reply(msg.encode()) == msg


def test_requests_and_replies_are_separate():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(P.Pong(1.0).encode())
    assert e.value.code is P.ErrorCode.UNKNOWN_OP


@pytest.mark.parametrize("frame,code", [
    (b"\xc1", P.ErrorCode.BAD_MSGPACK),
    (b"", P.ErrorCode.BAD_MSGPACK),
    (pack([1, 2]), P.ErrorCode.BAD_MSGPACK),
    (pack({1: "x"}), P.ErrorCode.BAD_MSGPACK),  # non-string keys refused by the decoder
    (pack({"op": "fetch"}) + b"trailing", P.ErrorCode.BAD_MSGPACK),
    (pack({"noop": 1}), P.ErrorCode.UNKNOWN_OP),
    (pack({"op": "welcome"}), P.ErrorCode.UNKNOWN_OP),
    (pack({"op": "fetch", "rid": 1.5, "keys": [[0, 0]]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": True, "keys": [[0, 0]]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": [[0, 0.0]]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": "0,0"}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": [[0, 0]] * 2}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": [[0, i] for i in range(P.MAX_KEYS + 1)]}), P.ErrorCode.TOO_LARGE),
    (pack({"op": "fetch", "rid": -1, "keys": [[0, 0]]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "release", "slot": 1}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "hello", "version": "1"}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "hello", "version": 1, "name": "x" * 1000}), P.ErrorCode.BAD_MESSAGE),  # names: bad_message
    (pack({"op": "hello", "version": 1, "name": "a\x1b[2Jb"}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "hello", "version": 1, "name": "a\nb"}), P.ErrorCode.BAD_MESSAGE),
    (b"\x00" * (P.MAX_FRAME_BYTES + 1), P.ErrorCode.TOO_LARGE),
    (pack({"op": "touch", "keys": [[0, 1]]}), P.ErrorCode.BAD_MESSAGE),  # no counts
    (pack({"op": "touch", "keys": [[0, 1]], "counts": [1, 2]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "touch", "keys": [[0, 1]], "counts": [0]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "touch", "keys": [[0, 1], [0, 1]], "counts": [1, 1]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "touch", "keys": [[0, 1]], "counts": [2], "uses": [1]}), P.ErrorCode.BAD_MESSAGE),  # < counts
    (pack({"op": "touch", "keys": [[0, 1]], "counts": [1], "uses": 3}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": [[0, 0]], "uses": [0]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": [[0, 0]], "uses": [1, 2]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": [[0, 0]], "uses": [1.5]}), P.ErrorCode.BAD_MESSAGE),
    (pack({"op": "fetch", "rid": 1, "keys": [[0, 0]], "priority": "ahead", "uses": [2]}),
     P.ErrorCode.BAD_MESSAGE),  # a prefetch is no use
])
def test_bad_requests(frame, code):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(frame)
    assert e.value.code is code
    reply = P.decode_reply(P.error_reply(e.value))
    assert isinstance(reply, P.Error) and reply.code == code.value


def test_fetch_errors_carry_the_request_id():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(pack({"op": "fetch", "rid": 12, "keys": [[0, "x"]]}))
    assert e.value.rid == 12


def test_no_pickle_or_extension_types():
    ext = msgpack.packb(msgpack.ExtType(1, b"evil"))
    with pytest.raises(P.ProtocolError):
        P.decode_request(pack({"op": "ping", "t": msgpack.ExtType(1, b"x")}))
    with pytest.raises(P.ProtocolError):
        P.decode_request(ext)


def test_escape_makes_names_safe_to_print():
    assert P.escape("decoder-1 é✓") == "decoder-1 é✓"
    assert P.escape("a\nb\x1b[2J\x07\u2028\\") == "a\\nb\\x1b[2J\\x07\\u2028\\\\"
    assert P.escape("a\nb").isprintable()
    hello = P.decode_request(P.Hello(P.PROTOCOL_VERSION, "décodeur ✓").encode())
    assert hello.name == "décodeur ✓"


@pytest.mark.parametrize("more, ok", [
    (None, True), ([[1, 2], [3, 4]], True), ([], True),
    ("x", False), ([[1]], False), ([[1, -2]], False), ([[1, 2]] * (P.MAX_KEYS + 1), False),
])
def test_release_with_more_pairs_is_validated(more, ok):
    frame = msgpack.packb({"op": "release", "slot": 0, "generation": 1, "more": more}, use_bin_type=True)
    if ok:
        assert P.decode_request(frame).leases() == [(0, 1), *((a, b) for a, b in more or ())]
    else:
        with pytest.raises(P.ProtocolError, match="more|generation|slot"):
            P.decode_request(frame)
