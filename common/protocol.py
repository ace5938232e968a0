"""Wire messages between moestream-iod and its clients, defined once, validated when decoded.

Every message is one ZeroMQ frame holding a msgpack map with an `op` key (the daemon's
ROUTER adds the peer identity frame). No pickle, no extension types, size limits on frames
and lists. `decode` turns bytes into a typed message or raises `ProtocolError` carrying the
`ErrorCode` for the `error` reply, so a bad message never reaches the daemon's logic.

    client -> daemon: hello, fetch, release, cancel, touch, ping, bye      (status socket: status)
    daemon -> client: welcome, ready (one per expert), error, pong, recall  (status socket: status_reply)

`recall` is additive (an older client logs it as an unknown reply and ignores it): the daemon
asks for leases back (`revoked` false: release them within `grace_s` if you are not computing
from them), or says it took them back (`revoked` true: their slots may be reused now).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any, ClassVar

import msgpack

# Where a system daemon (systemd/moestream-iod.service) listens; clients default to these.
DEFAULT_ENDPOINT = "ipc:///run/moestream/iod.sock"
DEFAULT_STATUS_ENDPOINT = "ipc:///run/moestream/status.sock"
PROTOCOL_VERSION = 3  # 2: `cached` fetches, `release` with `more` pairs; 3: the arena directory, `touch`
MAX_FRAME_BYTES = 256 << 10  # requests are small; anything bigger is refused unparsed
MAX_REPLY_BYTES = 16 << 20  # status replies and welcomes can carry tables
MAX_KEYS = 4096  # experts per fetch
MAX_NAME = 256  # client names, error messages are cut here
MAX_HOTTEST = 1 << 16  # experts one status reply may list as hottest (keeps it under MAX_REPLY_BYTES)
PRIORITIES = ("now", "ahead", "cached")  # cached: serve only from the arena, never read
# The welcome's `fingerprint` fields that say "the same model" (layout.Fingerprint computes them)
MODEL_IDENTITY = ("size", "header_sha256", "sample_sha256")


class ErrorCode(str, enum.Enum):
    BAD_MSGPACK = "bad_msgpack"  # frame is not a msgpack map
    BAD_MESSAGE = "bad_message"  # missing/mistyped field, wrong frame count
    UNKNOWN_OP = "unknown_op"
    BAD_VERSION = "bad_version"  # hello with another protocol version
    TOO_LARGE = "too_large"  # frame or list over the limits
    OUT_OF_RANGE = "out_of_range"  # (layer, expert) not in the model
    NOT_LEASED = "not_leased"  # release of a (slot, generation) this client does not hold
    NO_HELLO = "no_hello"  # request before hello (or the daemon restarted and forgot us)
    DUPLICATE_ID = "duplicate_id"  # fetch id already in use by this client
    BUSY = "busy"  # queue full: retry later
    DEADLINE = "deadline"  # waited queue_deadline_s for arena room (this client's lease quota, or a full arena):
    # the daemon is fine, the arena was busy; a decoder asks again (within its own total bound)
    DROPPED = "dropped"  # stale `ahead` work dropped
    NOT_CACHED = "not_cached"  # a `cached` fetch of an expert the arena does not hold (nothing is read)
    IO_ERROR = "io_error"  # the read failed
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


# Answers that fail nothing: the daemon gave an `ahead`/`cached` request up (stale, over quota,
# not in the arena). A decoder that needs the expert fetches it again `now`.
GIVEN_UP = frozenset({ErrorCode.DROPPED.value, ErrorCode.NOT_CACHED.value})


class ProtocolError(ValueError):
    def __init__(self, code: ErrorCode, message: str, rid: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message, self.rid = code, message[:MAX_NAME * 4], rid


# -- field checks (explicit: msgpack gives us whatever the peer sent) ----------------------
def _int(v: Any, name: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{name}={v} not in [{lo}, {hi}]")
    return v


def _num(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{name} must be a number, got {type(v).__name__}")
    return float(v)


def _str(v: Any, name: str, limit: int = MAX_NAME) -> str:
    if not isinstance(v, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{name} must be a string, got {type(v).__name__}")
    if len(v) > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{name} longer than {limit} characters")
    return v


def _client_name(v: Any) -> str:
    """A client name goes into logs and `moestream status`: printable characters only, bounded."""
    if not isinstance(v, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"name must be a string, got {type(v).__name__}")
    if len(v) > MAX_NAME:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"name longer than {MAX_NAME} characters")
    if not v.isprintable():
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"name {escape(v)[:80]!r} has non-printable characters "
                            "(control characters, newlines, escapes)")
    return v


def escape(text: str) -> str:
    """`text` with every non-printable character (and the backslash) written as a Python escape
    (\\n, \\x1b, \\u2028, \\\\), so what a peer chose cannot forge a log line or drive a terminal:
    for names, before they reach a log line or `moestream status`."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in text)


def _keys(v: Any) -> list[tuple[int, int]]:
    if not isinstance(v, list) or not v:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "keys must be a non-empty list of [layer, expert]")
    if len(v) > MAX_KEYS:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(v)} keys in one fetch (limit {MAX_KEYS})")
    out = []
    for k in v:
        if not isinstance(k, list) or len(k) != 2:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"key {k!r:.40} is not [layer, expert]")
        out.append((_int(k[0], "layer", 0, 2**31), _int(k[1], "expert", 0, 2**31)))
    if len(set(out)) != len(out):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "duplicate keys in one fetch")
    return out


def _counts(v: Any, keys: list, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) != len(keys):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{what} must be a list as long as the keys")
    return [_int(n, what, 1, 2**31) for n in v]


@cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


# -- messages -------------------------------------------------------------------------------
@dataclass
class Message:
    op: ClassVar[str] = ""

    def encode(self) -> bytes:
        # shallow on purpose (asdict deep-copies): this is on the per-expert hot path
        d = {name: getattr(self, name) for name in _names(type(self))}
        d["op"] = self.op
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Message:
        return cls(**{name: m[name] for name in _names(cls) if name in m})


@dataclass
class Hello(Message):
    op: ClassVar[str] = "hello"
    version: int
    name: str = ""
    pid: int = 0

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Hello:
        return cls(_int(m.get("version"), "version"), _client_name(m.get("name", "")), _int(m.get("pid", 0), "pid"))


@dataclass
class Welcome(Message):
    op: ClassVar[str] = "welcome"
    version: int
    fingerprint: dict
    arena_name: str
    n_slots: int
    slot_bytes: int
    index: dict
    heartbeat_s: float
    lease_timeout_s: float
    # leases (+ requests in progress) one client may claim while others are connected; 0: no quota.
    # A client that holds prefetched leases keeps them under this, or its own demand waits on them.
    lease_quota: int = 0
    queue_deadline_s: float = 0.0  # how long the daemon lets a request wait for arena room before `deadline`
    # where the arena's Directory lies ({offset, n_keys, max_parts}, common.arena); None: it has none
    directory: dict | None = None


@dataclass
class Fetch(Message):
    """Lease these experts. `uses` (a `now` fetch only, one per key, each >= 1): how many of the
    step's rows (tokens) the expert serves; the cache policy counts each as a use, where the
    request alone is one (a prompt's hot experts then weigh what they carry). None: one each."""

    op: ClassVar[str] = "fetch"
    rid: int
    keys: list
    priority: str = "now"
    uses: list | None = None

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Fetch:
        rid = _int(m.get("rid"), "rid")
        try:
            prio = _str(m.get("priority", "now"), "priority")
            if prio not in PRIORITIES:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"priority {prio!r:.20} is not one of {PRIORITIES}")
            keys, uses = _keys(m.get("keys")), m.get("uses")
            if uses is not None:
                if prio != "now":
                    raise ProtocolError(ErrorCode.BAD_MESSAGE, f"uses with priority {prio!r}: a prefetch is no use")
                uses = _counts(uses, keys, "uses")
            return cls(rid, keys, prio, uses)
        except ProtocolError as e:
            e.rid = rid  # so the client can fail the right futures
            raise


@dataclass
class Ready(Message):
    op: ClassVar[str] = "ready"
    rid: int
    layer: int
    expert: int
    slot: int
    generation: int
    parts: dict  # part name -> [offset inside the slot, nbytes]


@dataclass
class Release(Message):
    """Hand back one lease (slot, generation), plus optionally more: [[slot, generation], ...]
    (a decoder returns a layer's leases in one message)."""

    op: ClassVar[str] = "release"
    slot: int
    generation: int
    more: list | None = None

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Release:
        more = m.get("more")
        if more is not None:
            if not isinstance(more, list) or len(more) > MAX_KEYS:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"release 'more' must be a list of at most {MAX_KEYS} "
                                    "[slot, generation] pairs")
            more = [_pair(p) for p in more]
        return cls(_int(m.get("slot"), "slot", 0, 2**31), _int(m.get("generation"), "generation"), more)

    def leases(self) -> list[tuple[int, int]]:
        return [(self.slot, self.generation), *((p[0], p[1]) for p in self.more or ())]


def _pair(p: Any) -> list[int]:
    if not isinstance(p, list) or len(p) != 2:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "release 'more' entries must be [slot, generation]")
    return [_int(p[0], "slot", 0, 2**31), _int(p[1], "generation")]


@dataclass
class Cancel(Message):
    op: ClassVar[str] = "cancel"
    rid: int
    keys: list | None = None  # only these [layer, expert] of the request; None = all

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Cancel:
        keys = m.get("keys")
        return cls(_int(m.get("rid"), "rid"), None if keys is None else _keys(keys))


@dataclass
class Touch(Message):
    """Experts this client computed straight from the arena (read through the directory, no
    lease), each `counts[i]` times since its last touch: the daemon counts them as hits. Never
    answered; a client gathers them and sends one now and then."""

    op: ClassVar[str] = "touch"
    keys: list
    counts: list
    uses: list | None = None  # the rows (tokens) those computations served, each >= its count; None: counts

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Touch:
        keys, uses = _keys(m.get("keys")), m.get("uses")
        counts = _counts(m.get("counts"), keys, "counts")
        if uses is not None:
            uses = _counts(uses, keys, "uses")
            if any(u < n for u, n in zip(uses, counts)):
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "touch uses must be >= its counts (a row per computation)")
        return cls(keys, counts, uses)


@dataclass
class Ping(Message):
    op: ClassVar[str] = "ping"
    t: float = 0.0  # echoed in the pong; our client sends an integer ping id (0: its keepalive)

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Ping:
        return cls(_num(m.get("t", 0.0), "t"))


@dataclass
class Pong(Message):
    op: ClassVar[str] = "pong"
    t: float = 0.0


@dataclass
class Bye(Message):
    op: ClassVar[str] = "bye"

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Bye:
        return cls()


@dataclass
class Error(Message):
    op: ClassVar[str] = "error"
    code: str
    message: str
    rid: int | None = None
    keys: list | None = None  # the [layer, expert] of `rid` that failed; None = all of them


@dataclass
class Recall(Message):
    """Leases the daemon wants back: another peer needs the room (this one is over its quota)."""

    op: ClassVar[str] = "recall"
    leases: list  # [[slot, generation], ...]
    grace_s: float = 0.0  # how long the client has to release them before they are revoked
    revoked: bool = False  # true: taken back already, the slots may hold other experts now


@dataclass
class Status(Message):
    op: ClassVar[str] = "status"
    hottest: int = 10  # how many of the most requested experts the reply lists (`moestream warm --top N`)

    @classmethod
    def from_map(cls, m: dict[str, Any]) -> Status:
        return cls(_int(m.get("hottest", 10), "hottest", 0, MAX_HOTTEST))


@dataclass
class StatusReply(Message):
    op: ClassVar[str] = "status_reply"
    status: dict = field(default_factory=dict)


REQUESTS: dict[str, type[Message]] = {c.op: c for c in (Hello, Fetch, Release, Cancel, Touch, Ping, Bye, Status)}
REPLIES: dict[str, type[Message]] = {c.op: c for c in (Welcome, Ready, Error, Pong, StatusReply, Recall)}


def _unpack(frame: bytes, limit: int) -> dict[str, Any]:
    if len(frame) > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes (limit {limit})")
    try:
        m = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types (ExtraData, ValueError, UnicodeDecodeError...)
        raise ProtocolError(ErrorCode.BAD_MSGPACK, f"cannot decode msgpack: {type(e).__name__}") from None
    if not isinstance(m, dict):
        raise ProtocolError(ErrorCode.BAD_MSGPACK, f"message must be a msgpack map, got {type(m).__name__}")
    return m


def _decode(frame: bytes, table: dict[str, type[Message]], limit: int) -> Message:
    m = _unpack(frame, limit)
    op = m.get("op")
    cls = table.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r:.40}")
    try:
        return cls.from_map(m)
    except ProtocolError:
        raise
    except (TypeError, KeyError, ValueError) as e:  # only reachable for replies (trusted peer)
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"bad {op}: {e}") from None


def decode_request(frame: bytes) -> Message:
    """A client's request, validated; raises ProtocolError with the code for the error reply."""
    return _decode(frame, REQUESTS, MAX_FRAME_BYTES)


def decode_reply(frame: bytes) -> Message:
    """A daemon's reply (checked for shape only: the daemon is trusted)."""
    return _decode(frame, REPLIES, MAX_REPLY_BYTES)


def error_reply(e: ProtocolError) -> bytes:
    return Error(e.code.value, e.message, e.rid).encode()
