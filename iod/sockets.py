"""The daemon's two ROUTER sockets (requests, status): how they are made and drained.

zmq's FD is edge-triggered and only re-arms after `EVENTS` reports nothing to read, so a
drain ends on that check; it also sees requests that arrived while we sent (a send can
consume the edge).

Memory a peer can make the daemon hold, by bytes (libzmq counts messages, so the counts are
set from the byte limits):

| what                          | bound                                            | set by               |
|-------------------------------|--------------------------------------------------|----------------------|
| one frame                     | `MAX_WIRE_FRAME` (bigger: the peer is cut off before libzmq allocates it) | `MAXMSGSIZE` |
| requests queued per connection| `RECV_HWM` messages x `MAX_WIRE_FRAME` = `RECV_BYTES_PER_PEER` | `RCVHWM` |
| replies queued per connection | `max_replies_queued` replies (of at most ~1 KiB)  | `SNDHWM`             |

Frames are taken one at a time: a message over its frame count or byte total is read to its
end and dropped frame by frame, so Python never holds more than one frame past the limits.
What no option bounds: libzmq delivers a multipart message only once all its frames arrived,
so one message of many frames (each under `MAX_WIRE_FRAME`) is buffered whole before we can
drop it; the daemon gives that heap back afterwards (limits.trim_heap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import zmq

from moestream.common import protocol as P

# Frames between MAX_FRAME_BYTES and this get a `too_large` reply; bigger ones cost the peer its
# connection before libzmq allocates them (a 15 MiB frame must not cost 15 MiB).
MAX_WIRE_FRAME = P.MAX_FRAME_BYTES + (16 << 10)
ENVELOPE_BYTES = 1024  # identity and REQ delimiter frames on top of the one request frame
RECV_BYTES_PER_PEER = 16 << 20  # requests one connection may have waiting in libzmq for us
RECV_HWM = max(16, RECV_BYTES_PER_PEER // MAX_WIRE_FRAME)  # (a decoder sends a few per layer)


@dataclass(frozen=True)
class Oversize:
    """A message over its limits, already read to its end and dropped."""

    frames: int
    nbytes: int

    def describe(self, max_frames: int) -> str:
        return (f"message of {self.frames} frames, {self.nbytes} bytes dropped (limit {max_frames - 1} "
                f"frame(s), {P.MAX_FRAME_BYTES} bytes)")


def router(ctx: zmq.Context, send_hwm: int = 1 << 14) -> zmq.Socket:
    """A ROUTER; `send_hwm` replies may wait for each peer (one that does not read loses the rest)."""
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to vanished peers fail instead of vanishing
    s.setsockopt(zmq.LINGER, 200)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME)
    s.setsockopt(zmq.SNDHWM, send_hwm)
    s.setsockopt(zmq.RCVHWM, RECV_HWM)
    s.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT binds (IPv4 addresses still work)
    return s


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of an ipc connection, from the kernel (SO_PEERCRED, which libzmq
    appends to an ipc message's `Peer-Address` as ":uid:gid:pid"), not from what the peer says."""

    uid: int
    pid: int

    @classmethod
    def of(cls, address: str | None) -> Peer | None:
        parts = (address or "").rsplit(":", 3)
        if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            return None  # tcp: no credentials
        return cls(int(parts[1]), int(parts[3]))


def drain(sock: zmq.Socket, handle: Callable[..., None], batch: int, max_frames: int = 2,
          want_peer: Callable[[bytes], bool] | None = None) -> bool:
    """Handle up to `batch` waiting messages; True if more are still waiting (call again soon).

    `handle(frames, None)` gets a message of at most `max_frames` frames (identity included);
    `handle(kept, oversize)` the first frames of a bigger one, the rest already dropped. With
    `want_peer`, `handle` gets a third argument: the sender's `Peer` (or None) for identities
    `want_peer` asks about (new ones), else None."""
    for _ in range(batch):
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return False
        try:
            frames, over, peer = recv_bounded(sock, max_frames, P.MAX_FRAME_BYTES + ENVELOPE_BYTES, want_peer)
        except zmq.Again:  # EVENTS said readable but the message went (cannot happen on one thread)
            return False
        if want_peer is None:
            handle(frames, over)
        else:
            handle(frames, over, peer)
    return True


def recv_bounded(sock: zmq.Socket, max_frames: int, max_bytes: int,
                 want_peer: Callable[[bytes], bool] | None = None
                 ) -> tuple[list[bytes], Oversize | None, Peer | None]:
    """One message, frame by frame: past `max_frames` frames or `max_bytes` bytes the rest is read
    and dropped one frame at a time (a multipart message arrives whole, so this never blocks)."""
    frames = [sock.recv(zmq.NOBLOCK)]
    n, total, peer = 1, len(frames[0]), None
    while sock.getsockopt(zmq.RCVMORE):
        if n == 1 and want_peer is not None and want_peer(frames[0]):
            frame = sock.recv(zmq.NOBLOCK, copy=False)  # a Frame carries the connection's metadata
            try:
                peer = Peer.of(frame.get("Peer-Address"))
            except zmq.ZMQError:  # no such property (an older libzmq, an unusual transport)
                peer = None
            frame = frame.bytes
        else:
            frame = sock.recv(zmq.NOBLOCK)
        n, total = n + 1, total + len(frame)
        if n <= max_frames and total <= max_bytes:
            frames.append(frame)
    if n > max_frames or total > max_bytes:
        return frames[:max_frames], Oversize(n, total), peer
    return frames, None, peer
