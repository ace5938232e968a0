"""The client of moestream-iod used by decoders, benchmarks and tests (no torch).

One background thread owns the ZeroMQ DEALER socket (zmq sockets are not thread-safe): callers
on any thread queue commands and wake it through a pipe; it sends them, receives `ready`s and
completes one `Future[Lease]` per requested expert as each arrives. It pings the daemon so
the daemon keeps our leases, and declares the daemon gone (`IodUnavailable`) when it stops
answering, says it is shutting down, or no longer knows us (it restarted).
"""

from __future__ import annotations

import concurrent.futures as cf
import grp
import itertools
import logging
import os
import select
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import protocol as P
from .arena import ArenaError, ArenaView

log = logging.getLogger("moestream.client")
FINGERPRINT_FIELDS = ("size", "mtime_ns", "header_sha256")  # path may differ (symlinks, copies)


class IodError(Exception):
    pass


class IodUnavailable(IodError):
    """The daemon is gone, unreachable, restarted, or shutting down."""


class IodRequestError(IodError):
    """One request failed; the daemon is fine."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class FingerprintMismatch(IodError):
    """The daemon serves another version of the model file."""


@dataclass(frozen=True)
class Lease:
    layer: int
    expert: int
    slot: int
    generation: int
    parts: dict[str, tuple[int, int]]  # part name -> (offset inside the slot, nbytes)


class IodClient:
    def __init__(self, endpoint: str, *, expect_fingerprint: dict | None = None, timeout_s: float = 5.0,
                 name: str | None = None):
        problem = endpoint_problem(endpoint)
        if problem is not None:  # e.g. permission denied: waiting for a welcome would only hide it
            raise IodUnavailable(problem)
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._sock_lock = threading.Lock()
        self._last_send = time.monotonic()
        self._lock = threading.Lock()
        self._pending: dict[int, dict[tuple[int, int], cf.Future]] = {}  # rid -> key -> future
        self._pings: dict[float, cf.Future] = {}
        self._held: Counter = Counter()  # (slot, generation) -> leases held
        self._rids = itertools.count(1)
        self._dead: IodUnavailable | None = None
        self._closing = False
        self._welcome: cf.Future = cf.Future()
        self._heartbeat_s = 1.0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A dropped connection means the daemon died: fail fast instead of waiting for pings.
        self._mon = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.arena: ArenaView | None = None
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:  # a malformed endpoint: nothing was started yet, release what was made
            self._mon.close(linger=0)
            self._sock.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise IodUnavailable(f"bad moestream-iod endpoint {endpoint!r}: {e}") from None
        self._thread = threading.Thread(target=self._io_loop, name="iod-client", daemon=True)
        self._thread.start()
        try:
            self.welcome = self._handshake(name, expect_fingerprint)
        except BaseException:
            # Welcomed but refused here (fingerprint, arena): say bye so the daemon drops us now.
            self.close(send_bye=self._welcome.done() and not isinstance(self._welcome.result(), BaseException))
            raise

    # -- handshake ----------------------------------------------------------------------------
    def _handshake(self, name: str | None, expect: dict | None) -> dict:
        self._submit(P.Hello(P.PROTOCOL_VERSION, P.escape(name or f"pid-{os.getpid()}")[: P.MAX_NAME], os.getpid()).encode())
        try:
            msg = self._welcome.result(self.timeout_s)
        except cf.TimeoutError:
            raise IodUnavailable(no_answer(self.endpoint, self.timeout_s)) from None
        if isinstance(msg, BaseException):
            raise msg
        welcome = asdict(msg)
        if expect is not None:
            got = welcome["fingerprint"]
            diff = [f for f in FINGERPRINT_FIELDS if f in expect and expect[f] != got.get(f)]
            if diff:
                raise FingerprintMismatch(f"daemon serves {got.get('path')} with different "
                                          + ", ".join(f"{f} ({got.get(f)} != {expect[f]})" for f in diff))
        try:
            self.arena = ArenaView.attach(welcome["arena_name"], welcome["n_slots"], welcome["slot_bytes"])
        except ArenaError as e:
            raise IodUnavailable(str(e)) from None
        self._heartbeat_s = float(welcome["heartbeat_s"])
        return welcome

    # -- public API ---------------------------------------------------------------------------
    def fetch(self, keys: Sequence[tuple[int, int]], priority: str = "now") -> list[cf.Future]:
        """One future per key, completed with a Lease as each expert lands in the arena."""
        if priority not in P.PRIORITIES:
            raise ValueError(f"priority must be one of {P.PRIORITIES}, got {priority!r}")
        keys = [(int(layer), int(expert)) for layer, expert in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys in one fetch")
        futures: list[cf.Future] = []
        for i in range(0, len(keys), P.MAX_KEYS):
            futures += self._fetch_batch(keys[i : i + P.MAX_KEYS], priority)
        return futures

    def _fetch_batch(self, keys: list[tuple[int, int]], priority: str) -> list[cf.Future]:
        rid = next(self._rids)
        out = [cf.Future() for _ in keys]
        for k, f in zip(keys, out):
            f.iod_rid, f.iod_key = rid, k  # for cancel()
        with self._lock:
            if self._dead is not None:
                for f in out:
                    f.set_exception(self._dead)
                return out
            self._pending[rid] = dict(zip(keys, out))  # the I/O thread pops from this one
        self._submit(P.Fetch(rid, [list(k) for k in keys], priority).encode())
        return out

    def slot_view(self, lease: Lease) -> memoryview:
        if self._held.get((lease.slot, lease.generation), 0) <= 0:
            raise ValueError(f"lease {lease.layer, lease.expert} (slot {lease.slot}) is not held")
        return self.arena.slot(lease.slot)

    def part_view(self, lease: Lease, part: str) -> memoryview:
        """Read-only view of one part's bytes in the arena (valid until `release`)."""
        off, n = lease.parts[part]
        return self.slot_view(lease)[off : off + n]

    def release(self, lease: Lease) -> None:
        self.release_many([lease])

    def release_many(self, leases: Sequence[Lease]) -> None:
        """Hand back leases in one message (views of them must not be used afterwards)."""
        if not leases:
            return
        keys = [(lease.slot, lease.generation) for lease in leases]
        with self._lock:
            for lease, key in zip(leases, keys):
                if self._held.get(key, 0) < keys.count(key):
                    raise ValueError(f"lease {lease.layer, lease.expert} (slot {lease.slot}) is not held")
            for key in keys:
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
        more = [list(k) for k in keys[1:]] or None
        self._submit(P.Release(keys[0][0], keys[0][1], more).encode())

    def cancel(self, futures: Iterable[cf.Future]) -> None:
        """Cancel requests still pending (typically stale prefetches); leases that arrive anyway are released."""
        by_rid: dict[int, list] = {}
        for f in futures:
            if f.cancel() and hasattr(f, "iod_rid"):
                by_rid.setdefault(f.iod_rid, []).append(list(f.iod_key))
        for rid, keys in by_rid.items():
            with self._lock:
                pending = self._pending.get(rid, {})
                for k in keys:
                    pending.pop(tuple(k), None)
                whole = not pending
                if whole:
                    self._pending.pop(rid, None)
            self._submit(P.Cancel(rid, None if whole else keys).encode())

    def ping(self, timeout_s: float | None = None) -> float:
        """Round-trip seconds to the daemon."""
        t = time.monotonic()
        fut: cf.Future = cf.Future()
        with self._lock:
            self._pings[t] = fut
        self._submit(P.Ping(t).encode())
        try:
            fut.result(self.timeout_s if timeout_s is None else timeout_s)
        except cf.TimeoutError:
            raise IodUnavailable(f"no pong from {self.endpoint}") from None
        finally:
            self._pings.pop(t, None)
        return time.monotonic() - t

    def close(self, send_bye: bool = True) -> None:
        if self._closing:
            return
        if send_bye and self._dead is None:
            self._submit(P.Bye().encode())
        self._closing = True
        self._wake()
        self._thread.join(5.0)
        with self._sock_lock:
            self._sock.disable_monitor()
            self._mon.close(linger=0)
            self._sock.close(linger=100 if send_bye else 0)
        self._fail_all(IodUnavailable("client closed"))
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.arena is not None:
            self.arena.close()

    def __enter__(self) -> IodClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O thread ---------------------------------------------------------------------------
    def _submit(self, frame: bytes) -> None:
        """Send from the calling thread (no hop through the I/O thread: ~1/3 of a round trip).

        The socket is shared under `_sock_lock` (zmq sockets may move between threads given
        a full barrier). A send can swallow the edge of zmq's FD, so if a reply is already
        waiting afterwards, wake the I/O thread explicitly."""
        with self._sock_lock:
            if self._sock.closed:
                return
            try:
                self._sock.send(frame, zmq.NOBLOCK)
                readable = self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
            except zmq.ZMQError as e:  # send queue full: the daemon has not been reading for long
                readable, dead = False, e
            else:
                dead = None
            self._last_send = time.monotonic()
        if dead is not None:
            self._mark_dead(IodUnavailable(f"cannot send to moestream-iod at {self.endpoint}: {dead}"))
        if readable:
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # pipe full (a wake-up is pending anyway) or closed

    def _io_loop(self) -> None:
        poller = select.poll()
        mon_fd = self._mon.getsockopt(zmq.FD)
        for fd in (self._sock.getsockopt(zmq.FD), self._wake_r, mon_fd):
            poller.register(fd, select.POLLIN)
        last_recv = time.monotonic()
        while not self._closing:
            ready = {fd for fd, _ in poller.poll(int(self._heartbeat_s * 500))}
            if self._wake_r in ready:
                _drain_pipe(self._wake_r)
            self._check_monitor()  # ungated: zmq's FD only re-arms after a check that found nothing
            frames = []
            with self._sock_lock:
                if self._closing:
                    return
                while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames.append(self._sock.recv(zmq.NOBLOCK))
            now = time.monotonic()
            if frames:
                last_recv = now
            for frame in frames:
                self._on_reply(frame)
            if now - self._last_send > self._heartbeat_s:
                self._submit(P.Ping(-1.0).encode())
            if self._welcome.done() and now - last_recv > max(3 * self._heartbeat_s, self.timeout_s):
                self._mark_dead(IodUnavailable(f"moestream-iod at {self.endpoint} stopped answering"))

    def _check_monitor(self) -> None:
        while self._mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the monitor socket is this thread's alone
            event = recv_monitor_message(self._mon)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._mark_dead(IodUnavailable(f"lost the connection to moestream-iod at {self.endpoint}"))

    def _on_reply(self, frame: bytes) -> None:
        try:
            msg = P.decode_reply(frame)
        except P.ProtocolError as e:
            log.warning("bad reply from daemon: %s", e)
            return
        if isinstance(msg, P.Ready):
            self._on_ready(msg)
        elif isinstance(msg, P.Error):
            self._on_error(msg)
        elif isinstance(msg, P.Pong):
            fut = self._pings.get(msg.t)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, P.Welcome) and not self._welcome.done():
            self._welcome.set_result(msg)
        elif isinstance(msg, P.StatusReply) and not self._welcome.done():  # our hello reached a status socket
            ep = msg.status.get("endpoint") if isinstance(msg.status, dict) else None
            self._welcome.set_result(IodUnavailable(
                f"{self.endpoint} is moestream-iod's status endpoint (it answers `moestream status` only); "
                f"connect decoders to its request endpoint{f' {ep}' if ep else ''}"))

    def _on_ready(self, m: P.Ready) -> None:
        key = (m.layer, m.expert)
        lease = Lease(m.layer, m.expert, m.slot, m.generation, {k: (v[0], v[1]) for k, v in m.parts.items()})
        with self._lock:
            futs = self._pending.get(m.rid)
            fut = futs.pop(key, None) if futs is not None else None
            if futs is not None and not futs:
                del self._pending[m.rid]
            self._held[(m.slot, m.generation)] += 1
        try:
            if fut is None:
                raise cf.InvalidStateError("nobody waits for it")
            fut.set_result(lease)
        except cf.InvalidStateError:  # cancelled meanwhile: hand the slot straight back
            self.release(lease)

    def _on_error(self, m: P.Error) -> None:
        if m.code in (P.ErrorCode.SHUTTING_DOWN.value, P.ErrorCode.NO_HELLO.value) and m.keys is None:
            self._mark_dead(IodUnavailable(f"moestream-iod: {m.code}: {m.message}"))
            return
        if m.rid is None:
            text = f"{m.code}: {m.message}"
            log.warning("moestream-iod error: %s", text)
            if not self._welcome.done():
                self._welcome.set_result(IodUnavailable(f"handshake refused: {text}"))
            return
        exc: IodError = IodRequestError(m.code, m.message)
        if m.code == P.ErrorCode.SHUTTING_DOWN.value:
            exc = IodUnavailable(f"moestream-iod: {m.code}: {m.message}")
        with self._lock:
            futs = self._pending.get(m.rid, {})
            keys = list(futs) if m.keys is None else [tuple(k) for k in m.keys]
            failed = [futs.pop(k) for k in keys if k in futs]
            if not futs:
                self._pending.pop(m.rid, None)
        for f in failed:
            if not f.done():
                f.set_exception(exc)

    def _mark_dead(self, exc: IodUnavailable) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = exc
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            futs = [f for d in self._pending.values() for f in d.values()] + list(self._pings.values())
            self._pending.clear()
        if not self._welcome.done():
            self._welcome.set_result(exc)
        for f in futs:
            if not f.done():
                f.set_exception(exc)


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an `ipc://` endpoint; None for other transports and abstract `ipc://@name`."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        return endpoint[len("ipc://"):]
    return None


def endpoint_problem(endpoint: str) -> str | None:
    """What makes an ipc endpoint unusable by this process right now (ZeroMQ would retry silently):
    permission denied on the path, or a path that is not a socket. None if nothing is known wrong
    (a missing socket may still appear: the daemon may be starting)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except PermissionError:
        return (f"permission denied on the socket path {path} (a directory on it is not searchable by uid "
                f"{os.getuid()}): {_group_hint(path)}")
    except OSError as e:
        return f"cannot use the socket path {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket: is the endpoint right?"
    if not os.access(path, os.R_OK | os.W_OK):
        return f"permission denied on the socket {path} (uid {os.getuid()}): {_group_hint(path)}"
    return None


def no_answer(endpoint: str, timeout_s: float) -> str:
    """The message for a daemon that did not answer in time, saying what is known about the endpoint."""
    problem = endpoint_problem(endpoint)
    if problem is not None:
        return problem
    path = ipc_path(endpoint)
    head = f"no answer from moestream-iod at {endpoint} within {timeout_s}s"
    if path is not None and not os.path.lexists(path):
        return f"{head}: there is no socket at {path} (is the daemon running, and is this its endpoint?)"
    return f"{head} (is the daemon running, and is this its endpoint?)"


def _group_hint(path: str) -> str:
    """Which group to join, from the socket file (or its nearest visible parent)."""
    p = Path(path)
    for candidate in (p, *p.parents):
        try:
            gid = candidate.stat().st_gid
        except OSError:
            continue
        try:
            group = grp.getgrgid(gid).gr_name
        except KeyError:
            group = str(gid)
        return (f"the daemon's sockets are for group {group!r}; join it (usermod -aG {group} USER, then log in "
                "again) or ask the admin to set socket_group")
    return "ask the admin which group may use the daemon (socket_group)"


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
