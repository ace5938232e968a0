"""The daemon's request loop: a ZeroMQ ROUTER driven straight from the uvloop event loop.

The loop only routes small messages. It watches the socket's FD with `loop.add_reader` and
drains `recv_multipart(NOBLOCK)` (zmq.asyncio costs ~3x the round trip here). The io_uring
reader fills arena slots and its completions are reaped on this loop too (`LoopUringReader`;
the `threads` backend's workers hand theirs back with `loop.call_soon_threadsafe`); each
expert's `ready` goes out as soon as its bytes are in the arena. Every bad message gets an `error`
reply; nothing a client sends can stop the loop.

Fairness between peers (a user or a process, known from the kernel: peers.py): each share's
leases plus requests in progress stay within its quota (`IodConfig.lease_quota`) while another
share is connected; requests past it are parked with the client and admitted as the share's own
leases go back (`pump`), and leases held past it are recalled, then revoked (fairness.py). A
peer process that dies loses its leases at once (peers.DeathWatch). No request waits for arena
room longer than `queue_deadline_s`: a parked `now` request, or a `now` load that found every
slot leased for that long, is answered `deadline` saying who holds what (parked `ahead` ones go stale as
queued prefetches do). Prefetch leases never take the arena's last reserved slots: an `ahead`
or `cached` hit on an unleased slot is refused when only the reserve is free.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import zmq

from moestream.common import protocol as P
from moestream.common.arena import Arena
from moestream.common.layout import ModelLayout

from .clients import ClientState
from .config import IodConfig
from .fairness import Fairness
from .history import History
from .host_cache import HostCache
from .limits import rss_anon, trim_heap
from .peers import DeathWatch, Shares, share_key
from .readers import Reader, plan_reads
from .scheduler import Load, Scheduler, Waiter
from .sockets import Oversize, Peer, drain, router
from .status import Stats, StatusEndpoint, build_status

log = logging.getLogger("moestream.iod")
DRAIN_BATCH = 256  # messages handled per loop callback before yielding


class Server:
    def __init__(self, cfg: IodConfig, layout: ModelLayout, reader: Reader, arena: Arena, ctx: zmq.Context,
                 daemon_bytes: int = 0):
        self.cfg, self.layout, self.reader, self.arena = cfg, layout, reader, arena
        self.pid = os.getpid()
        self.cache = HostCache(arena, n_expert=layout.experts.n_expert,
                               part_names=lambda layer, e: [p.name for p in layout.experts.parts(layer, e)])
        # One expert load per device place: each load is >= 1 read (3 parts, or fewer once neighbours
        # merge), so `queue_depth` loads keep the reader `queue_depth` deep; the reader itself
        # caps what is at the device and takes demand chunks first. (Dividing by the parts per
        # expert, as before, capped a 40-expert batch at 10 loads.)
        self.sched = Scheduler(self.cache, self._start_read, max_inflight=cfg.queue_depth,
                               max_queued=cfg.max_queued, ahead_max_age_s=cfg.ahead_max_age_s,
                               on_dropped=self._on_dropped, reserve_reads=cfg.reserved(cfg.queue_depth),
                               reserve_slots=cfg.reserved(arena.n_slots), promote_read=self._promote_read)
        self.daemon_bytes = daemon_bytes  # the daemon's own memory as measured at start (for `memory`)
        self.stats = Stats()
        self.clients: dict[bytes, ClientState] = {}
        self.closing = False
        self.sock = router(ctx, cfg.max_replies_queued)
        self.status = StatusEndpoint(self, router(ctx))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = -1  # the loop's thread (`serve`): a loop-driven reader completes reads on it
        self._drain_scheduled = self._draining = False
        self.heartbeat_s = min(5.0, cfg.lease_timeout_s / 4)
        self.shares = Shares()
        self.fair = Fairness(self)
        self.deaths = DeathWatch(self._peer_exited)
        self._parked: set[bytes] = set()  # clients with parked requests
        self._trimmed_anon = 0  # anonymous memory after the last heap trim
        self.history = self._open_history()
        self.metrics = None
        self._metrics_http: asyncio.AbstractServer | None = None
        if cfg.metrics_port is not None:
            from .metrics import Metrics

            self.metrics = Metrics(self)

    def _open_history(self) -> History | None:
        """The on-disk request counts (`history_file`), loaded into `stats.hot`; None without one."""
        if self.cfg.history_file is None:
            return None
        ex = self.layout.experts
        history = History(self.cfg.history_file, self.layout.fingerprint.identity(), ex.n_layer, ex.n_expert)
        self.stats.hot.update(history.load())
        return history

    def save_history(self) -> None:
        if self.history is not None:
            self.history.save(self.stats.hot, self.stats.totals.requests)

    # -- lifecycle ----------------------------------------------------------------------------
    def bind(self) -> None:
        self.sock.bind(self.cfg.endpoint)
        self.status.sock.bind(self.cfg.status_endpoint)

    async def start_metrics(self) -> None:
        """Listen for metrics scrapes (before the daemon says it is ready: a scraper may come at once)."""
        if self.metrics is None:
            return
        from .metrics import serve_metrics

        try:
            self._metrics_http = await serve_metrics(self.metrics, self.cfg.metrics_port)
        except OSError as e:
            raise OSError(f"metrics port {self.cfg.metrics_port}: {e.strerror or e}") from None
        log.info("metrics on http://127.0.0.1:%d/metrics", self.cfg.metrics_port)

    async def serve(self, stop: asyncio.Event) -> None:
        self.loop = self.deaths.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.reader.start(self.loop)
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)
        self.status.start(self.loop)
        self._drain()
        tick, fair = self.loop.create_task(self._ticker()), self.loop.create_task(self._fair_ticker())
        try:
            await stop.wait()
            await self._shutdown()
        finally:
            tick.cancel()
            fair.cancel()
            self.deaths.close()
            self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
            self.status.stop()
            if self._metrics_http is not None:
                self._metrics_http.close()
            self.save_history()

    async def _shutdown(self, grace_s: float = 5.0) -> None:
        """Refuse new work, let running reads land, tell clients, then return."""
        self.closing = True
        for load in self.sched.take_queued():
            self._fail_load(load, P.ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
        for c in list(self.clients.values()):
            for w in c.expire_parked("now", float("inf")) + c.expire_parked("ahead", float("inf")):
                self._answer_error(w, P.ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
        self._parked.clear()
        deadline = time.monotonic() + grace_s
        while self.sched.reading and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for ident in list(self.clients):
            self.send(ident, P.Error(P.ErrorCode.SHUTTING_DOWN.value, "daemon is shutting down").encode())

    async def _ticker(self) -> None:
        period = min(1.0, self.cfg.lease_timeout_s / 4, self.cfg.queue_deadline_s / 4)
        next_save = time.monotonic() + self.cfg.history_interval_s
        while True:
            await asyncio.sleep(period)
            try:
                if time.monotonic() >= next_save:
                    next_save = time.monotonic() + self.cfg.history_interval_s
                    self.save_history()
                self._expire_clients()
                self.deaths.poll()
                self.sched.drop_stale()
                self._expire_waits()
                self.cache.step()  # hotness decays with time: the daemon does not see tokens
                self.pump()
                self._trim()
            except Exception:  # noqa: BLE001 — one bad tick must not end lease expiry for good
                log.exception("periodic work failed")

    async def _fair_ticker(self, period: float = 0.1) -> None:
        """Recalls and revocations on time (fairness.py): a demand waiting on another share's
        leases is served within about recall_grace_s, well inside queue_deadline_s."""
        while True:
            await asyncio.sleep(period)
            try:
                if len(self.shares) > 1:
                    self.fair.enforce()
            except Exception:  # noqa: BLE001
                log.exception("fairness work failed")

    def _trim(self, slack: int = 1 << 20) -> None:
        """Give freed heap back once it grew (a hostile burst, a big client gone): glibc keeps it."""
        anon = rss_anon()
        if anon > self._trimmed_anon + slack:
            trim_heap()
            self._trimmed_anon = rss_anon()

    def _expire_clients(self) -> None:
        cutoff = time.monotonic() - self.cfg.lease_timeout_s
        for c in [c for c in self.clients.values() if c.last_seen < cutoff]:
            log.info("client %s (pid %d) silent for %.1fs: freeing %d leases", P.escape(c.name), c.pid,
                     time.monotonic() - c.last_seen, sum(c.leases.values()))
            self.stats.clients_expired += 1
            self._drop_client(c)

    def _peer_exited(self, pid: int) -> None:
        """A peer process exited: its connections are gone, whatever its sockets' state."""
        gone = [c for c in self.clients.values() if c.peer_pid == pid]
        for c in gone:
            log.info("client %s (pid %d) exited: freeing %d leases", P.escape(c.name), pid, c.held)
            self.stats.clients_died += 1
            self._drop_client(c)

    def _drop_client(self, c: ClientState) -> None:
        if self.clients.pop(c.ident, None) is None:
            return
        self.shares.remove(c)
        if c.peer_pid and not any(x.peer_pid == c.peer_pid for x in self.clients.values()):
            self.deaths.unwatch(c.peer_pid)
        self._parked.discard(c.ident)
        self.sched.remove_waiters(lambda w: w.client == c.ident)
        for (slot, gen), n in c.leases.items():
            for _ in range(n):
                self.cache.release(slot, gen)
        c.leases.clear()
        c.leased_at.clear()
        c.recalled.clear()
        c.held = 0
        self.pump()

    # -- fairness -----------------------------------------------------------------------------
    def pump(self) -> None:
        """Admit parked requests of clients that have room again, then start what reads can start."""
        for ident in [] if self.closing else list(self._parked):
            c = self.clients.get(ident)
            while c is not None and (w := c.unpark(self.fair.quota_for(c), self.shares.claims(c))) is not None:
                self._admit(c, w, w.priority)
            if c is None or not c.n_parked():
                self._parked.discard(ident)
        self.sched.pump()

    def _expire_waits(self) -> None:
        """Answer what waited too long for arena room: parked `now` requests and slot-starved
        `now` loads after `queue_deadline_s` (`deadline`), parked prefetches when stale."""
        now = time.monotonic()
        for ident in list(self._parked):
            c = self.clients.get(ident)
            if c is None:
                continue
            quota = self.fair.quota_text(c)  # before the expired ones leave the parked count
            for w in c.expire_parked("now", now - self.cfg.queue_deadline_s):
                self._answer_deadline(w, f"waited {now - w.since:.1f}s over this client's lease quota: "
                                      f"{quota}; release leases to go on")
            for w in c.expire_parked("ahead", now - self.cfg.ahead_max_age_s):
                self._answer_error(w, P.ErrorCode.DROPPED, f"stale prefetch (parked {now - w.since:.1f}s over "
                                   f"this client's lease quota: {quota})")
        for load, waited in self.sched.expire_starved(self.cfg.queue_deadline_s, now):
            why = f"no arena slot free for {waited:.1f}s: {self.fair.holders_text()}"
            for w in load.waiters:
                self._answer_deadline(w, why)
            load.waiters = []

    def _answer_deadline(self, w: Waiter, message: str) -> None:
        c = self.clients.get(w.client)
        if c is not None:
            c.n.deadline += 1
            self.stats.totals.deadline += 1
        self._answer_error(w, P.ErrorCode.DEADLINE, message)

    def fairness(self) -> dict:
        """The `fairness` part of `status`."""
        return self.fair.status()

    # -- socket plumbing ----------------------------------------------------------------------
    def _drain(self) -> None:
        """Handle the requests waiting (a batch), then return to the loop. Sends made outside
        `_drain` (read completions, the ticker) schedule one, as a send can consume zmq's edge."""
        self._drain_scheduled = False
        self._draining = True
        try:
            more = drain(self.sock, self._handle_frames, DRAIN_BATCH, want_peer=self._unknown)
        finally:
            self._draining = False
        if more:
            self._schedule_drain()  # yield to completions first

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self.loop is not None:
            self._drain_scheduled = True
            self.loop.call_soon(self._drain)

    def send(self, ident: bytes, body: bytes) -> bool:
        """Queue one reply; False if it was dropped (peer gone, or its queue at the high-water mark)."""
        try:
            self.sock.send_multipart([ident, body], zmq.NOBLOCK, copy=True)
            sent = True
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or its queue is full
            log.debug("send to %r failed: %s", ident, e)
            sent = False
        if not self._draining:  # inside `_drain` its own EVENTS check covers this send
            self._schedule_drain()
        return sent

    def _unknown(self, ident: bytes) -> bool:
        return ident not in self.clients

    def _handle_frames(self, frames: list[bytes], over: Oversize | None = None, peer: Peer | None = None) -> None:
        ident = frames[0]
        try:
            if over is not None:  # already dropped unbuffered: only say why
                code = P.ErrorCode.BAD_MESSAGE if over.frames > 2 else P.ErrorCode.TOO_LARGE
                raise P.ProtocolError(code, over.describe(2))
            if len(frames) != 2:
                raise P.ProtocolError(P.ErrorCode.BAD_MESSAGE, f"expected 1 frame, got {len(frames) - 1}")
            self._dispatch(ident, P.decode_request(frames[1]), peer)
        except P.ProtocolError as e:
            self._error(ident, e.code, e.message, e.rid)
        except Exception as e:  # noqa: BLE001 — a bug answers `internal`, the loop carries on
            log.exception("internal error handling a message")
            self._error(ident, P.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _error(self, ident: bytes, code: P.ErrorCode, message: str, rid: int | None = None,
               keys: list | None = None) -> None:
        self.stats.errors_by_code[code.value] += 1
        self.stats.totals.errors += 1
        c = self.clients.get(ident)
        if c is not None:
            c.n.errors += 1
        self.send(ident, P.Error(code.value, message, rid, keys).encode())

    # -- requests -----------------------------------------------------------------------------
    def _dispatch(self, ident: bytes, msg: P.Message, peer: Peer | None = None) -> None:
        c = self.clients.get(ident)
        if c is not None:
            c.last_seen = time.monotonic()
        if isinstance(msg, P.Ping):
            self.send(ident, P.Pong(msg.t).encode())
        elif isinstance(msg, P.Hello):
            self._hello(ident, msg, peer)
        elif isinstance(msg, P.Status):
            self.send(ident, P.StatusReply(build_status(self, msg.hottest)).encode())
        elif c is None:
            rid = msg.rid if isinstance(msg, P.Fetch) else None
            raise P.ProtocolError(P.ErrorCode.NO_HELLO, f"send hello before {msg.op}", rid)
        elif isinstance(msg, P.Fetch):
            self._fetch(c, msg)
        elif isinstance(msg, P.Release):
            self._release(c, msg)
        elif isinstance(msg, P.Cancel):
            self._cancel(c, msg)
        elif isinstance(msg, P.Touch):
            self._touch(c, msg)
        elif isinstance(msg, P.Bye):
            self._drop_client(c)

    def _hello(self, ident: bytes, msg: P.Hello, peer: Peer | None) -> None:
        if msg.version != P.PROTOCOL_VERSION:
            raise P.ProtocolError(P.ErrorCode.BAD_VERSION, f"protocol version {msg.version}, daemon speaks {P.PROTOCOL_VERSION}")
        if self.closing:
            raise P.ProtocolError(P.ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
        if ident not in self.clients:
            self._add_client(ident, msg, peer)
        a = self.arena
        self.send(ident, P.Welcome(P.PROTOCOL_VERSION, self.layout.fingerprint.as_dict(), a.name, a.n_slots,
                                    a.slot_bytes, self.layout.experts.summary(), self.heartbeat_s,
                                    self.cfg.lease_timeout_s, self.fair.quota_int() or 0,
                                    self.cfg.queue_deadline_s, a.directory_geometry).encode())

    def _add_client(self, ident: bytes, msg: P.Hello, peer: Peer | None) -> None:
        c = ClientState(ident, msg.name or f"client-{msg.pid}", msg.pid, time.monotonic(),
                        share=share_key(self.cfg.fair_by, peer, ident), peer_pid=peer.pid if peer else 0)
        shares_before = len(self.shares)
        self.clients[ident] = c
        self.shares.add(c)
        self.stats.clients_seen += 1
        self.deaths.watch(c.peer_pid)
        if len(self.shares) > shares_before > 0:  # a second share: the first one's leases fall under the quota
            self.fair.enforce()

    def _fetch(self, c: ClientState, msg: P.Fetch) -> None:
        if self.closing:
            raise P.ProtocolError(P.ErrorCode.SHUTTING_DOWN, "daemon is shutting down", msg.rid)
        if msg.rid in c.pending:
            raise P.ProtocolError(P.ErrorCode.DUPLICATE_ID, f"request id {msg.rid} is still pending", msg.rid)
        cap = self.cfg.max_queued_per_client
        if c.outstanding + len(msg.keys) > cap:  # what one client can make the daemon hold is bounded
            c.n.busy += 1
            self.stats.totals.busy += 1
            raise P.ProtocolError(P.ErrorCode.BUSY, f"{c.outstanding} experts requested and not yet answered; "
                                  f"{len(msg.keys)} more would pass this client's limit of {cap}", msg.rid)
        total = sum(x.outstanding for x in self.clients.values())
        if total + len(msg.keys) > self.cfg.max_requests_total:  # and what all of them can, together
            c.n.busy += 1
            self.stats.totals.busy += 1
            raise P.ProtocolError(P.ErrorCode.BUSY, f"{total} experts requested by all clients and not yet "
                                  f"answered; {len(msg.keys)} more would pass the daemon's limit of "
                                  f"{self.cfg.max_requests_total} (max_requests_total)", msg.rid)
        index = self.layout.experts
        n_layer, n_expert = index.n_layer, index.n_expert
        for layer, expert in msg.keys:
            if layer >= n_layer or expert >= n_expert:
                raise P.ProtocolError(P.ErrorCode.OUT_OF_RANGE, f"expert ({layer}, {expert}) not in "
                                      f"[0,{n_layer}) x [0,{n_expert})", msg.rid)
            if not index.is_moe_layer(layer):  # a leading dense layer (DeepSeek): nothing to serve
                raise P.ProtocolError(P.ErrorCode.OUT_OF_RANGE, f"expert ({layer}, {expert}): layer {layer} "
                                      f"has a dense FFN, no experts", msg.rid)
        c.add_pending(msg.rid, len(msg.keys))
        for key, n in zip(msg.keys, msg.uses or ()):  # the rows beyond the one each request counts
            self.cache.credit(key, n - 1)
        t0 = time.monotonic()
        c.unsorted = len(msg.keys)
        try:
            for key in msg.keys:
                c.unsorted -= 1
                self._fetch_one(c, Waiter(c.ident, msg.rid, key, t0, msg.priority), msg.priority)
        finally:
            c.unsorted = 0
        self.pump()

    def _fetch_one(self, c: ClientState, w: Waiter, priority: str) -> None:
        c.n.requests += 1
        self.stats.totals.requests += 1
        self.stats.hot[w.key] += 1
        if c.must_park(priority, self.fair.quota_for(c), self.shares.claims(c)):
            if priority == "cached":  # a guess: worth a lease now or never
                self._answer_error(w, P.ErrorCode.NOT_CACHED, f"not leased: {self.fair.quota_text(c)}")
                return
            w.since = time.monotonic()
            c.parked[priority].append(w)
            c.n.over_quota += 1
            self.stats.totals.over_quota += 1
            self._parked.add(c.ident)
            return
        self._admit(c, w, priority)

    def _admit(self, c: ClientState, w: Waiter, priority: str) -> None:
        """Serve a request within its client's quota: a hit, a join, or a new load."""
        slot = self.cache.lookup_ready(w.key)
        if slot is not None:
            if priority != "now" and not self.cache.slots[slot].leases and \
                    self.cache.free_slots() <= self.sched.reserve_slots:
                # leasing it would pin one of the slots kept free for demand
                code = P.ErrorCode.NOT_CACHED if priority == "cached" else P.ErrorCode.DROPPED
                self._answer_error(w, code, f"prefetch not leased: the last {self.sched.reserve_slots} free arena "
                                   "slots are kept for demand (`now`) requests")
                return
            c.n.hits += 1
            self.stats.totals.hits += 1
            self._serve(c, w, slot)
            return
        load = self.sched.find(w.key)
        if load is not None:
            c.n.joined += 1
            self.stats.totals.joined += 1
            self.sched.join(load, w, "ahead" if priority == "cached" else priority)
            return
        if priority == "cached":  # a guess worth a lease (in the arena or on its way), not a read
            self._answer_error(w, P.ErrorCode.NOT_CACHED, "not in the arena")
            return
        c.n.misses += 1
        self.stats.totals.misses += 1
        if not self.sched.enqueue(w, priority):
            self._answer_error(w, P.ErrorCode.BUSY, "request queue full")

    def _cancel(self, c: ClientState, msg: P.Cancel) -> None:
        keys = None if msg.keys is None else {tuple(k) for k in msg.keys}
        n = self.sched.remove_waiters(lambda w: w.client == c.ident and w.rid == msg.rid, keys)
        n += c.remove_parked(lambda w: w.rid == msg.rid and (keys is None or w.key in keys))
        c.answered(msg.rid, n)
        self.pump()

    def _touch(self, c: ClientState, msg: P.Touch) -> None:
        """Experts `c` computed straight from the arena (the directory): counted as the hits
        they are, for the decayed LFU, the request history and `moestream status`. No reply."""
        index = self.layout.experts
        for key in msg.keys:
            if key[0] >= index.n_layer or key[1] >= index.n_expert:
                raise P.ProtocolError(P.ErrorCode.OUT_OF_RANGE, f"touch of expert {key} not in "
                                      f"[0,{index.n_layer}) x [0,{index.n_expert})")
        for key, n, uses in zip(msg.keys, msg.counts, msg.uses or msg.counts):
            self.stats.hot[key] += n
            counted = n if self.cache.touch(key, n) else 0  # (0: evicted since)
            c.n.direct_hits += counted
            self.stats.totals.direct_hits += counted
            self.cache.credit(key, uses - counted)  # the rows the touches did not count, resident or not

    def _release(self, c: ClientState, msg: P.Release) -> None:
        bad = []
        for slot, generation in msg.leases():
            if not c.drop_lease(slot, generation):
                bad.append(f"slot {slot} generation {generation}")
                continue
            c.n.releases += 1
            self.stats.totals.releases += 1
            self.cache.release(slot, generation)
        self.pump()
        if bad:  # the others were released: one bad pair does not cost the client its good ones
            raise P.ProtocolError(P.ErrorCode.NOT_LEASED, f"{', '.join(bad[:4])} not leased to you")

    # -- answers ------------------------------------------------------------------------------
    def _serve(self, c: ClientState, w: Waiter, slot: int, miss: bool = False) -> None:
        """Send one `ready` and lease the slot to `c` only if the reply was queued: a reply dropped
        at the high-water mark (a client that does not read) leaves no lease and no count behind."""
        c.answered(w.rid)
        info = self.cache.slots[slot]
        ready = P.Ready(w.rid, w.key[0], w.key[1], slot, info.generation, info.parts)
        if not self.send(c.ident, ready.encode()):
            c.n.replies_dropped += 1
            self.stats.totals.replies_dropped += 1
            return
        c.add_lease(slot, self.cache.lease(slot))
        c.n.readies += 1
        c.n.bytes_served += info.nbytes
        self.stats.totals.readies += 1
        self.stats.totals.bytes_served += info.nbytes
        waited = time.monotonic() - w.t0
        self.stats.latency_all.append(waited)
        if self.metrics is not None:
            self.metrics.observe_fetch(waited, miss)

    def _answer_error(self, w: Waiter, code: P.ErrorCode, message: str) -> None:
        c = self.clients.get(w.client)
        if c is None:
            return
        self._error(w.client, code, message, w.rid, [list(w.key)])
        c.answered(w.rid)

    def _fail_load(self, load: Load, code: P.ErrorCode, message: str) -> None:
        for w in load.waiters:
            self._answer_error(w, code, message)
        load.waiters = []

    def _on_dropped(self, load: Load, why: str) -> None:
        self._fail_load(load, P.ErrorCode.DROPPED, why)

    # -- reads --------------------------------------------------------------------------------
    def _start_read(self, load: Load) -> None:
        parts = self.layout.experts.parts(*load.key)
        ops, load.parts = plan_reads(parts, self.arena.slot(load.slot), direct=self.cfg.direct)
        try:
            load.handle = self.reader.submit(ops, lambda exc: self._read_finished(load, exc),
                                             ahead=load.priority == "ahead")
        except Exception as e:  # noqa: BLE001 — e.g. reader closed: fail this load, not the loop
            self.loop.call_soon(self._read_done, load, e)

    def _read_finished(self, load: Load, exc: BaseException | None) -> None:
        """From the reader: on this loop's thread (a loop-driven reader, or its `close` after the
        loop ended), or one of its own."""
        if self.loop.is_closed():  # a read that outlived the shutdown grace: no one left to tell
            return
        if threading.get_ident() == self._loop_thread:
            self.loop.call_soon(self._read_done, load, exc)  # (after the reap: no self-pipe write)
        else:
            _call_soon(self.loop, self._read_done, load, exc)

    def _promote_read(self, load: Load) -> None:
        if load.handle is not None:
            self.reader.promote(load.handle)

    def _read_done(self, load: Load, exc: BaseException | None) -> None:
        self.sched.finished(load)
        if exc is not None:
            log.warning("read of expert %s failed: %s", load.key, exc)
            self.stats.read_errors += 1
            self.cache.abort_load(load.slot)
            self._fail_load(load, P.ErrorCode.IO_ERROR, f"read failed: {exc}")
        else:
            self.cache.finish_load(load.slot, load.parts)
            self.stats.read_done(self.cache.slots[load.slot].nbytes)
            now = time.monotonic()
            for w in load.waiters:
                c = self.clients.get(w.client)
                if c is not None and w.rid in c.pending:
                    self.stats.latency_miss.append(now - w.t0)
                    self._serve(c, w, load.slot, miss=True)
            self.cache.unpin_load(load.slot)
        self.pump()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:  # noqa: ANN001
    """From a reader thread: a read that outlived the shutdown grace lands on a closed loop."""
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed between the check and the call
            pass
