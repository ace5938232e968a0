"""Counters the daemon keeps, and the `status` reply built from them.

`hits + joined + misses == requests`: a hit found the expert complete in the arena, a join
attached to a read already queued or running (single-flight), a miss queued a new read.
`direct_hits` are not requests: experts a decoder computed straight from the arena through its
directory, no lease, reported afterwards (`touch`); the hit rate counts them as the hits they are.
`bytes_served` is the sum of the blob sizes of every `ready` sent; `bytes_read` the blob bytes
the readers delivered; `disk_read_bytes` what the kernel says this process read from storage.
Depth: `queues.in_flight` counts expert loads reading, `reader.in_flight` the device reads
(one per part, fewer where neighbours merge) — each with its peak, time-weighted mean while
busy and the share of busy time per level (see `depth_gauge.py`).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from moestream.common import protocol as P
from moestream.common.procfs import proc_cpu_s

from .sockets import Oversize, drain


if TYPE_CHECKING:
    import asyncio

    from .server import Server

log = logging.getLogger("moestream.iod")

LATENCY_SAMPLES = 20000
THROUGHPUT_WINDOW_S = 10.0


@dataclass
class ClientCounters:
    requests: int = 0
    hits: int = 0
    joined: int = 0
    misses: int = 0
    readies: int = 0
    bytes_served: int = 0
    errors: int = 0
    releases: int = 0
    busy: int = 0  # fetches refused: the client's own limit of outstanding experts (max_queued_per_client)
    replies_dropped: int = 0  # `ready`s that could not be queued (client not reading): no lease kept
    over_quota: int = 0  # requests that had to wait (parked) for room within the client's lease quota
    deadline: int = 0  # requests answered `deadline` (no arena room within queue_deadline_s)
    recalled: int = 0  # leases the daemon asked back (another share needed the room)
    revoked: int = 0  # recalled leases not given back within recall_grace_s, taken back
    direct_hits: int = 0  # experts computed from the arena through the directory (reported by `touch`)


class Samples:
    """The last `n` latency samples in a preallocated ring of doubles: a million requests cost no
    memory past its 8 * n bytes, and no float objects scattered through the heap (which would keep
    the pages of a hostile burst's freed requests from going back to the system)."""

    def __init__(self, n: int = LATENCY_SAMPLES):
        self._a = array("d", bytes(8 * n))
        self._next = self._len = 0

    def append(self, x: float) -> None:
        self._a[self._next] = x
        self._next = (self._next + 1) % len(self._a)
        self._len = min(self._len + 1, len(self._a))

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return iter(self._a[: self._len] if self._len < len(self._a) else self._a)


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    cpu_start: float | None = field(default_factory=proc_cpu_s)  # CPU seconds spent before serving (imports, load)
    totals: ClientCounters = field(default_factory=ClientCounters)
    reads: int = 0  # expert reads completed
    read_errors: int = 0
    bytes_read: int = 0
    errors_by_code: Counter = field(default_factory=Counter)
    hot: Counter = field(default_factory=Counter)  # (layer, expert) -> requests
    latency_all: Samples = field(default_factory=Samples)
    latency_miss: Samples = field(default_factory=Samples)
    recent_reads: deque = field(default_factory=deque)  # (t_done, nbytes) in the last window
    clients_seen: int = 0
    clients_expired: int = 0
    clients_died: int = 0  # dropped at once: their process exited (peers.DeathWatch)

    def read_done(self, nbytes: int) -> None:
        now = time.monotonic()
        self.reads += 1
        self.bytes_read += nbytes
        self.recent_reads.append((now, nbytes))
        while self.recent_reads and now - self.recent_reads[0][0] > THROUGHPUT_WINDOW_S:
            self.recent_reads.popleft()

    def read_mb_s(self) -> float:
        now = time.monotonic()
        recent = [n for t, n in self.recent_reads if now - t <= THROUGHPUT_WINDOW_S]
        window = min(THROUGHPUT_WINDOW_S, max(1e-3, now - self.started_mono))
        return sum(recent) / window / 1e6


def _since(start: float | None, now: float | None) -> float | None:
    return None if start is None or now is None else round(now - start, 3)


def percentiles(samples: Samples) -> dict[str, float | int]:
    if not samples:
        return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0}
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1e3  # noqa: E731
    return {"n": len(s), "p50_ms": round(pick(0.5), 4), "p99_ms": round(pick(0.99), 4)}


def build_status(server: Server, hottest: int = 10) -> dict[str, Any]:
    """The `status` reply: plain msgpack-able types only; the `hottest` most requested experts
    (request counts since the history began: see `history.py`)."""
    st, cfg, layout = server.stats, server.cfg, server.layout
    t = st.totals
    reader = server.reader.stats()
    return {
        "pid": server.pid,
        "uptime_s": round(time.monotonic() - st.started_mono, 3),
        # CPU seconds since the server started, all threads, user + system: on a host with no core to
        # spare beside the decoders' threads, taken from their kernels
        "cpu_s": _since(st.cpu_start, proc_cpu_s()),
        "started": st.started,
        "model": str(layout.path),
        "fingerprint": layout.fingerprint.as_dict(),
        "arch": layout.hparams.arch,
        "index": layout.experts.summary(),
        "endpoint": cfg.endpoint,
        "backend": {"name": server.reader.name, "note": server.reader.note, "direct": cfg.direct,
                    "queue_depth": cfg.queue_depth, "registered": server.reader.registered},
        # (as configured; `reader` has its live counters)
        "arena": {"name": server.arena.name, **server.cache.stats()},
        "memory": {"budget": cfg.memory, "daemon_bytes": server.daemon_bytes,  # budget None: arena sized directly
                   "arena_bytes": server.arena.n_slots * server.arena.slot_bytes},
        "requests": t.requests, "hits": t.hits, "joined": t.joined, "misses": t.misses,
        "direct_hits": t.direct_hits,
        "hit_rate": (t.hits + t.joined + t.direct_hits) / (t.requests + t.direct_hits)
        if t.requests + t.direct_hits else 0.0,
        "readies": t.readies, "releases": t.releases, "errors": t.errors,
        "replies_dropped": t.replies_dropped, "client_busy": t.busy,
        "errors_by_code": dict(st.errors_by_code),
        "reads": st.reads, "read_errors": st.read_errors, "bytes_read": st.bytes_read,
        "bytes_served": t.bytes_served,
        "disk_read_bytes": reader["disk_read_bytes"],  # since the reader opened the file
        "read_mb_s": round(st.read_mb_s(), 3),
        "reader": reader,
        "queues": server.sched.stats(),
        "fairness": server.fairness(),
        "latency": {"all": percentiles(st.latency_all), "miss": percentiles(st.latency_miss)},
        "clients": [c.describe() for c in server.clients.values()],
        "clients_seen": st.clients_seen, "clients_expired": st.clients_expired, "clients_died": st.clients_died,
        "hottest": [[k[0], k[1], n] for k, n in st.hot.most_common(hottest)],
    }


class StatusEndpoint:
    """The separate status socket (ROUTER: answers REQ and DEALER peers); always answers."""

    def __init__(self, server: Server, sock: zmq.Socket):
        self.server, self.sock = server, sock
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)
        self._drain()

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.remove_reader(self.sock.getsockopt(zmq.FD))

    def _drain(self) -> None:
        if drain(self.sock, self._reply, 64, max_frames=3):  # REQ peers add an empty delimiter frame
            self.loop.call_soon(self._drain)

    def _reply(self, frames: list[bytes], over: Oversize | None = None) -> None:
        if over is not None:
            body = P.Error(P.ErrorCode.TOO_LARGE.value, over.describe(3)).encode()
        else:
            body = self._answer(frames[-1])
        try:
            self.sock.send_multipart([*frames[:-1], body], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the asker left

    def _answer(self, frame: bytes) -> bytes:
        try:
            msg = P.decode_request(frame)  # any valid request is answered with the status
            return P.StatusReply(build_status(self.server, msg.hottest if isinstance(msg, P.Status) else 10)).encode()
        except P.ProtocolError as e:
            return P.error_reply(e)
        except Exception as e:  # noqa: BLE001
            log.exception("status failed")
            return P.Error(P.ErrorCode.INTERNAL.value, f"status failed: {e}").encode()
