"""The client of moestream-iod used by decoders, benchmarks and tests (no torch).

One I/O thread owns the ZeroMQ DEALER socket (zmq sockets are not thread-safe) and all the
request bookkeeping: callers on any thread hand it commands (fetch, release, cancel, ping,
close) through a queue and wake it through an eventfd, the way vLLM's engine client hands its
output thread work through an inproc pair. It keeps one record per request id, completes one
`Future[Lease]` per requested expert as its `ready` arrives, and pings the daemon so the
daemon keeps our leases.

Connection states (`State`), all changed by the I/O thread only::

    CONNECTING --welcome--> CONNECTED --lost--> RECONNECTING --welcome--> CONNECTED
         |                      |                    |
         +--refused/timeout-----+--close/no retry----+--gave up (reconnect_s) / other model--> DEAD

"Lost" is a dropped connection, `shutting_down`, `no_hello` (the daemon restarted and forgot
us) or no answer to pings. Recovering from it means: a fresh socket, `hello` again until
`reconnect_s` runs out, the same model identity (`FINGERPRINT_FIELDS`), the new daemon's arena
attached, and every request still outstanding sent again (same id, the keys not delivered).
Leases are counted per connection (`epoch`): a loss voids every lease of the old one (the old
daemon's slots may be reused; its arena is not the new one), `part_view` of a void lease raises
`LeaseVoided`, releasing one is a no-op, and an expert source fetches it again. Dead is final:
every request fails with `IodUnavailable` saying why.

The arena's directory (`ArenaView.directory`, when the daemon publishes one) says which expert
each slot holds: an expert source may compute one that is there without any request, checks
the slot's sequence number afterwards, and reports such hits with `touch`.

Recalls (the daemon needs room for another peer): a `recall` names leases to hand back soon;
they are collected for the expert source (`take_recalled`), which releases those it is not
computing from. A `recall` with `revoked` says the daemon took them back: they are void like
a lost connection's (`voided`, `LeaseVoided`), and releasing them is a no-op.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import protocol as P
from .arena import ArenaError, ArenaView
from .endpoints import endpoint_problem, no_answer

log = logging.getLogger("moestream.client")
# What identifies the model (path, mtime may differ: copies, symlinks, `touch`); see layout.Fingerprint.
FINGERPRINT_FIELDS = P.MODEL_IDENTITY
_WHAT = {"size": "file size", "header_sha256": "header/tensor table", "sample_sha256": "tensor data sample"}
RETRY_PAUSE_S = 0.2  # between handshake attempts while reconnecting
KEEPALIVE = 0  # ping id of the I/O thread's own pings (callers' ids start at 1)


class IodError(Exception):
    pass


class IodUnavailable(IodError):
    """The daemon is gone, unreachable, did not come back after a restart, or shutting down."""


class IodRequestError(IodError):
    """One request failed; the daemon is fine."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class FingerprintMismatch(IodUnavailable):
    """The daemon serves another model file (unusable for this decoder)."""


class LeaseVoided(IodError):
    """The lease belongs to a connection that was lost: its slot must not be read; fetch the expert again."""


class State(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"  # recoverable: requests are kept and sent again
    DEAD = "dead"  # final: requests fail


@dataclass(frozen=True)
class Lease:
    layer: int
    expert: int
    slot: int
    generation: int
    parts: dict[str, tuple[int, int]]  # part name -> (offset inside the slot, nbytes)
    epoch: int = 0  # the connection it was granted on (void once the client reconnected)


@dataclass
class _Request:
    """One fetch request id: the futures of its keys not answered yet (popped as answers come)."""

    rid: int
    priority: str
    futures: dict[tuple[int, int], cf.Future]
    uses: dict[tuple[int, int], int] | None = None  # rows per key (`fetch`'s uses), None: one each

    def message(self) -> bytes:
        keys = list(self.futures)
        uses = None if self.uses is None else [self.uses[k] for k in keys]
        return P.Fetch(self.rid, [list(k) for k in keys], self.priority,
                       uses if uses and max(uses) > 1 else None).encode()


def fingerprint_mismatch(expect: dict, got: dict) -> str | None:
    """What differs between the model we opened (`expect`) and the one the daemon serves, or None."""
    diff = [f for f in FINGERPRINT_FIELDS if f in expect and expect[f] != got.get(f)]
    if not diff:
        return None
    what = "; ".join(f"{_WHAT[f]} differs ({f} {_short(expect[f])} here, "
                     + (f"{_short(got[f])} at the daemon)" if f in got else "not reported by the daemon (an older "
                        "moestream-iod?))") for f in diff)
    if diff == ["sample_sha256"] and "sample_sha256" in got:
        what += " (same size and header: same shapes, other weights)"
    return f"the daemon serves {got.get('path')}, not the model {expect.get('path')} opened here: {what}"


def _short(v: Any) -> str:
    return f"{v[:12]}..." if isinstance(v, str) and len(v) > 16 else str(v)


class IodClient:
    """A daemon connection that survives restarts (module docstring). `reconnect_s`: how long to
    try to get a lost daemon back (0: a loss is final at once)."""

    def __init__(self, endpoint: str, *, expect_fingerprint: dict | None = None, timeout_s: float = 5.0,
                 name: str | None = None, reconnect_s: float = 30.0):
        problem = endpoint_problem(endpoint)
        if problem is not None:  # e.g. permission denied: waiting for a welcome would only hide it
            raise IodUnavailable(problem)
        if reconnect_s < 0:
            raise ValueError(f"reconnect_s must be >= 0, got {reconnect_s}")
        self.endpoint, self.timeout_s, self.reconnect_s = endpoint, timeout_s, reconnect_s
        self._name = P.escape(name or f"pid-{os.getpid()}")[: P.MAX_NAME]
        self._expect = expect_fingerprint  # None: the first daemon's fingerprint, once welcomed
        self._lock = threading.Lock()  # guards the fields callers read: state, epoch, arena, held
        self._changed = threading.Condition(self._lock)
        self.state, self.epoch, self.reconnects = State.CONNECTING, 0, 0
        self.bytes_received = 0  # blob bytes of every `ready` (used, prefetched or handed back); I/O thread writes
        self._dead: IodUnavailable | None = None
        self._held: Counter = Counter()  # (slot, generation) -> leases of this epoch held
        self._recalled: set[tuple[int, int]] = set()  # asked back by the daemon, not yet taken
        self._touched: list[tuple[int, list[int]]] = []  # (layer, experts) lease-free hits not yet reported (`touch`)
        self._revoked: set[tuple[int, int]] = set()  # taken back by the daemon (this epoch)
        self.recalls = {"recalled": 0, "revoked": 0}  # leases, since start
        self.arena: ArenaView | None = None
        self.welcome: dict = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._rids, self._ping_ids = itertools.count(1), itertools.count(KEEPALIVE + 1)
        self._closed = False
        try:
            self._io = _IoThread(self)  # creates and connects the first socket here: a bad endpoint raises now
        except BaseException:
            os.close(self._wake_fd)
            raise
        self._io.start()
        with self._changed:
            self._changed.wait_for(lambda: self.state is not State.CONNECTING, timeout_s + 5.0)
            dead = self._dead
            if self.state is State.CONNECTING:  # (the I/O thread decides this itself; belt and braces)
                dead = IodUnavailable(no_answer(endpoint, timeout_s))
        if dead is not None:
            self.close()
            raise dead

    # -- public API ---------------------------------------------------------------------------
    def fetch(self, keys: Sequence[tuple[int, int]], priority: str = "now",
              uses: Sequence[int] | None = None) -> list[cf.Future]:
        """One future per key, completed with a Lease as each expert lands in the arena (kept
        across a reconnect; failed with IodUnavailable once the client is dead). `uses` (`now`
        only): the rows of the step each key serves, for the daemon's cache policy (P.Fetch)."""
        if priority not in P.PRIORITIES:
            raise ValueError(f"priority must be one of {P.PRIORITIES}, got {priority!r}")
        keys = [(int(layer), int(expert)) for layer, expert in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys in one fetch")
        if uses is not None and (priority != "now" or len(uses) != len(keys) or min(uses, default=1) < 1):
            raise ValueError("uses: one count >= 1 per key, and only for a `now` fetch")
        by_key = None if uses is None else dict(zip(keys, (int(n) for n in uses)))
        futures: list[cf.Future] = []
        for i in range(0, len(keys), P.MAX_KEYS):
            batch = keys[i : i + P.MAX_KEYS]
            req = _Request(next(self._rids), priority, {k: cf.Future() for k in batch}, by_key)
            for k, f in req.futures.items():
                f.iod_rid, f.iod_key = req.rid, k  # for cancel()
            futures += req.futures.values()  # before the hand-over: from then on the record is the I/O thread's
            self._send_command(("fetch", req))
        return futures

    def voided(self, lease: Lease) -> bool:
        """Whether `lease` was granted on a connection since lost, or revoked by the daemon (its
        slot must not be read)."""
        return lease.epoch != self.epoch or (lease.slot, lease.generation) in self._revoked

    def take_recalled(self) -> set[tuple[int, int]]:
        """The (slot, generation) leases the daemon asked back since the last call (release the
        ones not being computed from; the others go back anyway once computed)."""
        if not self._recalled:  # (the common case: no lock taken; a recall set meanwhile waits a call)
            return set()
        with self._lock:
            out, self._recalled = self._recalled, set()
        return out

    def arena_of(self, lease: Lease) -> ArenaView:
        """The arena `lease` lives in; raises LeaseVoided when its connection was lost."""
        with self._lock:
            if lease.epoch != self.epoch or self.arena is None:
                raise LeaseVoided(f"lease of expert {lease.layer, lease.expert} voided by a lost connection")
            if (lease.slot, lease.generation) in self._revoked:
                raise LeaseVoided(f"lease of expert {lease.layer, lease.expert} taken back by the daemon")
            return self.arena

    def slot_view(self, lease: Lease) -> memoryview:
        arena = self.arena_of(lease)
        if self._held.get((lease.slot, lease.generation), 0) <= 0:
            raise ValueError(f"lease {lease.layer, lease.expert} (slot {lease.slot}) is not held")
        return arena.slot(lease.slot)

    def part_view(self, lease: Lease, part: str) -> memoryview:
        """Read-only view of one part's bytes in the arena (valid until `release`)."""
        off, n = lease.parts[part]
        return self.slot_view(lease)[off : off + n]

    def release(self, lease: Lease) -> None:
        self.release_many([lease])

    def release_many(self, leases: Sequence[Lease]) -> None:
        """Hand back leases in one message (views of them must not be used afterwards). Void
        leases are skipped: the daemon that granted them is gone or has forgotten us."""
        with self._lock:
            epoch = self.epoch
            keys = [(lease.slot, lease.generation) for lease in leases
                    if lease.epoch == epoch and (lease.slot, lease.generation) not in self._revoked]
            for lease in leases:
                key = (lease.slot, lease.generation)
                if key in keys and self._held.get(key, 0) < keys.count(key):
                    raise ValueError(f"lease {lease.layer, lease.expert} (slot {lease.slot}) is not held")
            for key in keys:
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
        if keys:
            self._send_command(("release", keys, epoch))

    def touch(self, layer: int, experts: list[int], rows: list[int] | None = None) -> None:
        """Report experts of `layer` computed straight from the arena through its directory (hits
        that took no lease; an expert listed n times counts n), so the daemon's decayed LFU and
        history see them; `rows` (one per expert, default 1): the rows (tokens) each served, the
        uses its policy weighs. Never answered; dropped while not connected (it is a hint)."""
        # Kept here, not queued: the I/O thread sends what gathered in one message whenever it
        # runs next (its next command or timer). No wake-up: that would cost the compute thread a
        # GIL hand-over per step, and a queue of one message per step could fill the socket. A
        # list append (atomic under the GIL) is all the compute thread pays; the I/O thread counts.
        self._touched.append((int(layer), experts, rows))

    def _take_touched(self) -> list[tuple[tuple[int, int], int, int]]:
        """(key, times computed, rows served) of the touches gathered since the last call, by key."""
        with self._lock:
            out, self._touched = self._touched, []
        counts, uses = Counter(), Counter()
        for layer, es, rows in out:
            for i, e in enumerate(es):
                counts[layer, int(e)] += 1
                uses[layer, int(e)] += 1 if rows is None else int(rows[i])
        return [(k, n, uses[k]) for k, n in sorted(counts.items())]

    def cancel(self, futures: Iterable[cf.Future]) -> None:
        """Cancel requests still pending (typically stale prefetches); leases that arrive anyway are released."""
        by_rid: dict[int, list] = {}
        for f in futures:
            if f.cancel() and hasattr(f, "iod_rid"):
                by_rid.setdefault(f.iod_rid, []).append(f.iod_key)
        for rid, keys in by_rid.items():
            self._send_command(("cancel", rid, keys))

    def ping(self, timeout_s: float | None = None) -> float:
        """Round-trip seconds to the daemon (waits through a reconnect, up to the timeout)."""
        t, fut = time.monotonic(), cf.Future()
        self._send_command(("ping", next(self._ping_ids), fut))
        try:
            fut.result(self.timeout_s if timeout_s is None else timeout_s)
        except cf.TimeoutError:
            fut.cancel()
            raise IodUnavailable(f"no pong from {self.endpoint}") from None
        return time.monotonic() - t

    def close(self, send_bye: bool = True) -> None:
        if self._closed:
            return
        self._send_command(("close", send_bye))
        self._closed = True
        self._io.join(5.0)
        self._io.fail_leftovers(IodUnavailable("client closed"))
        os.close(self._wake_fd)
        with self._lock:
            if self.arena is not None:
                self.arena.close()
                self.arena = None

    def __enter__(self) -> IodClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hand-over to the I/O thread ------------------------------------------------------------
    def _send_command(self, cmd: tuple) -> None:
        if self._closed:  # no I/O thread to answer: fail what waits for an answer
            self._commands.put(cmd)
            self._io.fail_leftovers(IodUnavailable("client closed"))
            return
        self._commands.put(cmd)
        os.eventfd_write(self._wake_fd, 1)

    def _set_state(self, state: State, dead: IodUnavailable | None = None) -> None:
        with self._changed:
            if self.state is State.DEAD:
                return
            if state in (State.RECONNECTING, State.DEAD) and self.state is State.CONNECTED:
                self.epoch += 1  # every lease of the lost connection is void
                self._held.clear()
                self._recalled.clear()
                self._revoked.clear()
            self.state = state
            if dead is not None:
                self._dead = dead
            self._changed.notify_all()

    @property
    def lease_quota(self) -> int | None:
        """Leases this client may claim at once while others share the daemon (None: no quota)."""
        return self.welcome.get("lease_quota") or None

    def _attach(self, welcome: dict) -> None:
        """A welcome: check the model, map its arena (the previous one goes: its leases are void)."""
        problem = fingerprint_mismatch(self._expect, welcome["fingerprint"]) if self._expect else None
        if problem is not None:
            raise FingerprintMismatch(f"moestream-iod at {self.endpoint}: {problem}")
        try:
            arena = ArenaView.attach(welcome["arena_name"], welcome["n_slots"], welcome["slot_bytes"],
                                     welcome.get("directory"))
        except ArenaError as e:
            raise IodUnavailable(str(e)) from None
        with self._lock:
            old, self.arena, self.welcome = self.arena, arena, welcome
            if self._expect is None:
                self._expect = welcome["fingerprint"]  # a restarted daemon must serve this same model
        if old is not None:
            old.close()  # views still exported keep the old mapping until they go


class _IoThread(threading.Thread):
    """Owns the socket, the request records and the ping ids; the only writer of the client's state."""

    def __init__(self, client: IodClient):
        super().__init__(name="iod-client", daemon=True)
        self.c = client
        self.requests: dict[int, _Request] = {}
        self.pings: dict[int, cf.Future] = {}
        self.sock: zmq.Socket | None = None
        self.mon: zmq.Socket | None = None
        self.heartbeat_s = 1.0
        self.last_send = self.last_recv = self.last_ping = time.monotonic()
        self.attempt_end = time.monotonic() + client.timeout_s  # this handshake's deadline
        self.give_up_at = 0.0  # end of the reconnect window
        self.retry_at: float | None = None  # next handshake attempt (after a refusal)
        self.lost_reason = ""
        self.running = True
        self.poller: zmq.Poller | None = None  # rebuilt with each socket
        self._new_socket()

    # -- socket -------------------------------------------------------------------------------
    def _new_socket(self) -> None:
        self._close_socket(linger=0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT (IPv4 endpoints still work)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # a dropped connection: the daemon died
        try:
            sock.connect(self.c.endpoint)
        except zmq.ZMQError as e:  # a malformed endpoint (found on the first socket, in the constructor)
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close(linger=0)
            raise IodUnavailable(f"bad moestream-iod endpoint {self.c.endpoint!r}: {e}") from None
        self.sock, self.mon, self.poller = sock, mon, None
        self.last_send = self.last_recv = time.monotonic()
        self._send(P.Hello(P.PROTOCOL_VERSION, self.c._name, os.getpid()).encode())

    def _close_socket(self, linger: int) -> None:
        if self.sock is not None:
            self.sock.disable_monitor()
            self.mon.close(linger=0)
            self.sock.close(linger=linger)
            self.sock = self.mon = self.poller = None

    def _send(self, frame: bytes) -> None:
        if self.sock is None:  # lost meanwhile: what matters is sent again once reconnected
            return
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # send queue full: the daemon has not been reading for long
            self._lost(f"cannot send to moestream-iod at {self.c.endpoint}: {e}")
        self.last_send = time.monotonic()

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # a bug here must not leave callers waiting forever
            log.exception("iod client I/O thread failed")
            self._die(IodUnavailable(f"client I/O thread failed: {type(e).__name__}: {e}"))
            self._close_socket(linger=0)

    def _loop(self) -> None:
        while self.running:
            ready = dict(self._poller().poll(self._poll_ms()))
            if self.c._wake_fd in ready:
                _drain_eventfd(self.c._wake_fd)
            self._commands()
            self._send_touched()
            if self.sock is not None and self.mon in ready:
                self._check_monitor()
            if self.sock is not None and self.sock in ready:
                self._receive()
            self._timers(time.monotonic())
        self._close_socket(linger=100)

    def _poller(self) -> zmq.Poller:
        if self.poller is None:
            self.poller = zmq.Poller()
            self.poller.register(self.c._wake_fd, zmq.POLLIN)
            if self.sock is not None:
                self.poller.register(self.sock, zmq.POLLIN)
                self.poller.register(self.mon, zmq.POLLIN)
        return self.poller

    def _poll_ms(self) -> int:
        """How long the loop may sleep with nothing to do: its timers are heartbeats when
        connected, handshake deadlines and retries otherwise."""
        wait = self.heartbeat_s / 2 if self.c.state is State.CONNECTED else RETRY_PAUSE_S / 4
        return max(1, int(wait * 1000))

    def _commands(self) -> None:
        while self.running:
            try:
                cmd = self.c._commands.get_nowait()
            except queue.Empty:
                return
            getattr(self, f"_cmd_{cmd[0]}")(*cmd[1:])

    def _receive(self) -> None:
        while self.sock is not None and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = self.sock.recv(zmq.NOBLOCK)
            self.last_recv = time.monotonic()
            self._on_reply(frame)

    def _timers(self, now: float) -> None:
        state = self.c.state
        if state is State.CONNECTED:
            # a ping when we have been quiet, or when only unanswered messages went out (touch,
            # release): the daemon's silence must mean it is gone, not that nothing asked it
            if now - self.last_send > self.heartbeat_s or \
                    (now - self.last_recv > self.heartbeat_s and now - self.last_ping > self.heartbeat_s):
                self._send(P.Ping(KEEPALIVE).encode())
                self.last_ping = now
            if now - self.last_recv > max(3 * self.heartbeat_s, self.c.timeout_s):
                self._lost(f"moestream-iod at {self.c.endpoint} stopped answering")
        elif state is State.CONNECTING and now > self.attempt_end:
            self._die(IodUnavailable(no_answer(self.c.endpoint, self.c.timeout_s)))
        elif state is State.RECONNECTING:
            if now > self.give_up_at:
                self._die(IodUnavailable(
                    f"moestream-iod at {self.c.endpoint} did not come back within {self.c.reconnect_s:g}s "
                    f"(reconnect wait) after {self.lost_reason}"))
            elif now >= (self.retry_at if self.retry_at is not None else self.attempt_end):
                self._attempt(now)  # after a refusal's pause, or an attempt that got no welcome

    # -- connection state -------------------------------------------------------------------------
    def _lost(self, reason: str) -> None:
        """The daemon went away: reconnect (requests kept), or die when reconnecting is off."""
        state = self.c.state
        if state is State.RECONNECTING:
            self.retry_at = time.monotonic() + RETRY_PAUSE_S  # this attempt failed: another soon
            self._close_socket(linger=0)
            return
        if state is not State.CONNECTED or self.c.reconnect_s <= 0:
            self._die(IodUnavailable(reason if state is State.CONNECTED else f"handshake failed: {reason}"))
            return
        log.warning("%s; reconnecting (for up to %gs)", reason, self.c.reconnect_s)
        self.lost_reason, now = reason, time.monotonic()
        self.give_up_at = now + self.c.reconnect_s
        self.c._set_state(State.RECONNECTING)
        self._close_socket(linger=0)
        self.retry_at = now  # at once: a restarted daemon may already listen

    def _attempt(self, now: float) -> None:
        self.retry_at = None
        self.attempt_end = min(now + self.c.timeout_s, self.give_up_at)
        self._new_socket()

    def _welcomed(self, msg: P.Welcome) -> None:
        try:
            self.c._attach(asdict(msg))
        except IodUnavailable as e:  # another model, or an arena we cannot map: final
            self._send(P.Bye().encode())
            self._die(e)
            return
        self.heartbeat_s = float(msg.heartbeat_s)
        again = self.c.state is State.RECONNECTING
        self.c._set_state(State.CONNECTED)
        if again:
            self.c.reconnects += 1
            log.warning("reconnected to moestream-iod at %s; sending %d outstanding requests again",
                        self.c.endpoint, len(self.requests))
            for req in self.requests.values():
                self._send(req.message())
            for pid in self.pings:
                self._send(P.Ping(pid).encode())

    def _die(self, exc: IodUnavailable) -> None:
        if self.c.state is State.DEAD:
            return
        self.c._set_state(State.DEAD, exc)
        self._close_socket(linger=100)  # a `bye` just sent still goes out
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        futures = [f for r in self.requests.values() for f in r.futures.values()] + list(self.pings.values())
        self.requests.clear()
        self.pings.clear()
        for f in futures:
            _fail(f, exc)

    def fail_leftovers(self, exc: BaseException) -> None:
        """After the thread ended (close): fail what it had, and commands it never read."""
        self._fail_all(exc)
        while True:
            try:
                cmd = self.c._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "fetch":
                for f in cmd[1].futures.values():
                    _fail(f, exc)
            elif cmd[0] == "ping":
                _fail(cmd[2], exc)

    # -- commands (from callers) ------------------------------------------------------------------
    def _cmd_fetch(self, req: _Request) -> None:
        if self.c.state is State.DEAD:
            for f in req.futures.values():
                _fail(f, self.c._dead)
            return
        self.requests[req.rid] = req
        if self.c.state is State.CONNECTED:
            self._send(req.message())  # otherwise sent once (re)connected

    def _cmd_release(self, keys: list[tuple[int, int]], epoch: int) -> None:
        if self.c.state is State.CONNECTED and epoch == self.c.epoch:  # else void: the daemon forgot them
            self._send(P.Release(keys[0][0], keys[0][1], [list(k) for k in keys[1:]] or None).encode())

    def _send_touched(self) -> None:
        """The lease-free hits gathered since the last call, in as few messages as fit."""
        if self.c.state is not State.CONNECTED or not self.c._touched:
            return
        touched = self.c._take_touched()
        for i in range(0, len(touched), P.MAX_KEYS):
            batch = touched[i:i + P.MAX_KEYS]
            uses = [u for _, _, u in batch]
            self._send(P.Touch([list(k) for k, _, _ in batch], [n for _, n, _ in batch],
                               uses if any(u > n for _, n, u in batch) else None).encode())

    def _cmd_cancel(self, rid: int, keys: list[tuple[int, int]]) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        gone = [k for k in keys if k in req.futures]
        for k in gone:
            del req.futures[k]
        if not req.futures:
            del self.requests[rid]
        if gone and self.c.state is State.CONNECTED:
            self._send(P.Cancel(rid, None if not req.futures else [list(k) for k in gone]).encode())

    def _cmd_ping(self, pid: int, fut: cf.Future) -> None:
        if self.c.state is State.DEAD:
            _fail(fut, self.c._dead)
            return
        self.pings = {i: f for i, f in self.pings.items() if not f.done()}  # callers that gave up
        self.pings[pid] = fut
        if self.c.state is State.CONNECTED:
            self._send(P.Ping(pid).encode())

    def _cmd_close(self, send_bye: bool) -> None:
        if send_bye and self.c.state is State.CONNECTED:
            self._send_touched()
            self._send(P.Bye().encode())
        self.c._set_state(State.DEAD, IodUnavailable("client closed"))
        self.running = False

    # -- replies ------------------------------------------------------------------------------------
    def _check_monitor(self) -> None:
        while self.mon is not None and self.mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if recv_monitor_message(self.mon)["event"] == zmq.EVENT_DISCONNECTED:
                self._lost(f"lost the connection to moestream-iod at {self.c.endpoint}")

    def _on_reply(self, frame: bytes) -> None:
        try:
            msg = P.decode_reply(frame)
        except P.ProtocolError as e:
            log.warning("bad reply from daemon: %s", e)
            return
        handshaking = self.c.state in (State.CONNECTING, State.RECONNECTING)
        if isinstance(msg, P.Ready):
            self._on_ready(msg)
        elif isinstance(msg, P.Error):
            self._on_error(msg)
        elif isinstance(msg, P.Recall):
            self._on_recall(msg)
        elif isinstance(msg, P.Pong):
            fut = self.pings.pop(int(msg.t), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, P.Welcome) and handshaking:
            self._welcomed(msg)
        elif isinstance(msg, P.StatusReply) and handshaking:  # our hello reached a status socket
            ep = msg.status.get("endpoint") if isinstance(msg.status, dict) else None
            self._die(IodUnavailable(
                f"{self.c.endpoint} is moestream-iod's status endpoint (it answers `moestream status` only); "
                f"connect decoders to its request endpoint{f' {ep}' if ep else ''}"))

    def _on_ready(self, m: P.Ready) -> None:
        key = (m.layer, m.expert)
        req = self.requests.get(m.rid)
        fut = req.futures.pop(key, None) if req is not None else None
        if req is not None and not req.futures:
            del self.requests[m.rid]
        c = self.c
        lease = Lease(m.layer, m.expert, m.slot, m.generation, {k: (v[0], v[1]) for k, v in m.parts.items()}, c.epoch)
        c.bytes_received += sum(n for _, n in lease.parts.values())  # what the daemon counts as served to us
        with c._lock:
            c._held[(m.slot, m.generation)] += 1
        try:
            if fut is None:
                raise cf.InvalidStateError("nobody waits for it")
            fut.set_result(lease)
        except cf.InvalidStateError:  # cancelled meanwhile: hand the slot straight back
            c.release(lease)

    def _on_recall(self, m: P.Recall) -> None:
        c = self.c
        keys = {(int(p[0]), int(p[1])) for p in m.leases}
        with c._lock:
            keys &= set(c._held)  # what we still hold (released meanwhile: nothing to do)
            if m.revoked:
                for key in keys:
                    del c._held[key]
                c._revoked |= keys
                c._recalled -= keys
            else:
                c._recalled |= keys
            c.recalls["revoked" if m.revoked else "recalled"] += len(keys)
        if m.revoked and keys:
            log.info("moestream-iod took back %d leases (recalled, not released within %gs)", len(keys), m.grace_s)

    def _on_error(self, m: P.Error) -> None:
        if m.code in (P.ErrorCode.SHUTTING_DOWN.value, P.ErrorCode.NO_HELLO.value):
            self._lost(f"moestream-iod at {self.c.endpoint}: {m.code}: {m.message}")  # requests kept
            return
        if m.rid is None:
            text = f"{m.code}: {m.message}"
            if self.c.state in (State.CONNECTING, State.RECONNECTING):
                self._die(IodUnavailable(f"handshake refused: {text}"))
            else:
                log.warning("moestream-iod error: %s", text)
            return
        req = self.requests.get(m.rid)
        if req is None:
            return
        keys = list(req.futures) if m.keys is None else [tuple(k) for k in m.keys]
        failed = [req.futures.pop(k) for k in keys if k in req.futures]
        if not req.futures:
            del self.requests[m.rid]
        for f in failed:
            _fail(f, IodRequestError(m.code, m.message))


def _fail(f: cf.Future, exc: BaseException) -> None:
    try:
        f.set_exception(exc)
    except cf.InvalidStateError:
        pass  # done or cancelled already


def _drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass
