"""The daemon's two ROUTER sockets (requests, status): how they are made and drained.

zmq's FD is edge-triggered and only re-arms after `EVENTS` reports nothing to read, so a
drain ends on that check; it also sees requests that arrived while we sent (a send can
consume the edge).

Memory one message can cost: libzmq refuses any frame over `MAX_WIRE_FRAME` while decoding its
header (the peer loses its connection, nothing is allocated); frames are then taken one at a
time and a message over its frame count or byte total is read to its end and dropped frame by
frame, so Python never holds more than one frame past the limits. (libzmq itself delivers a
multipart message only once all its frames arrived: a peer can still make it buffer many
frames of up to `MAX_WIRE_FRAME` each; no libzmq option caps a message's frame count.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import zmq

from moestream.common import protocol as P

# Frames between MAX_FRAME_BYTES and this get a `too_large` reply; bigger ones cost the peer its
# connection before libzmq allocates them (a 15 MiB frame must not cost 15 MiB).
MAX_WIRE_FRAME = 4 * P.MAX_FRAME_BYTES
ENVELOPE_BYTES = 1024  # identity and REQ delimiter frames on top of the one request frame


@dataclass(frozen=True)
class Oversize:
    """A message over its limits, already read to its end and dropped."""

    frames: int
    nbytes: int

    def describe(self, max_frames: int) -> str:
        return (f"message of {self.frames} frames, {self.nbytes} bytes dropped (limit {max_frames - 1} "
                f"frame(s), {P.MAX_FRAME_BYTES} bytes)")


def router(ctx: zmq.Context, send_hwm: int = 1 << 16) -> zmq.Socket:
    """A ROUTER; `send_hwm` replies may wait for each peer (one that does not read loses the rest)."""
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to vanished peers fail instead of vanishing
    s.setsockopt(zmq.LINGER, 200)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME)
    s.setsockopt(zmq.SNDHWM, send_hwm)
    s.setsockopt(zmq.RCVHWM, 1 << 16)
    return s


def drain(sock: zmq.Socket, handle: Callable[[list[bytes], Oversize | None], None], batch: int,
          max_frames: int = 2) -> bool:
    """Handle up to `batch` waiting messages; True if more are still waiting (call again soon).

    `handle(frames, None)` gets a message of at most `max_frames` frames (identity included);
    `handle(kept, oversize)` the first frames of a bigger one, the rest already dropped."""
    for _ in range(batch):
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return False
        try:
            frames, over = recv_bounded(sock, max_frames, P.MAX_FRAME_BYTES + ENVELOPE_BYTES)
        except zmq.Again:  # EVENTS said readable but the message went (cannot happen on one thread)
            return False
        handle(frames, over)
    return True


def recv_bounded(sock: zmq.Socket, max_frames: int, max_bytes: int) -> tuple[list[bytes], Oversize | None]:
    """One message, frame by frame: past `max_frames` frames or `max_bytes` bytes the rest is read
    and dropped one frame at a time (a multipart message arrives whole, so this never blocks)."""
    frames = [sock.recv(zmq.NOBLOCK)]
    n, total = 1, len(frames[0])
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(zmq.NOBLOCK)
        n, total = n + 1, total + len(frame)
        if n <= max_frames and total <= max_bytes:
            frames.append(frame)
    if n > max_frames or total > max_bytes:
        return frames[:max_frames], Oversize(n, total)
    return frames, None
