"""The daemon's two ROUTER sockets (requests, status): how they are made and drained.

zmq's FD is edge-triggered and only re-arms after `EVENTS` reports nothing to read, so a
drain ends on that check; it also sees requests that arrived while we sent (a send can
consume the edge).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from moestream.common import protocol as P


def router(ctx: zmq.Context) -> zmq.Socket:
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to vanished peers fail instead of vanishing
    s.setsockopt(zmq.LINGER, 200)
    # Frames over MAX_FRAME_BYTES get a `too_large` reply; absurd ones cost the peer its connection.
    s.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_BYTES)
    s.setsockopt(zmq.SNDHWM, 1 << 16)
    s.setsockopt(zmq.RCVHWM, 1 << 16)
    return s


def drain(sock: zmq.Socket, handle: Callable[[list[bytes]], None], batch: int) -> bool:
    """Handle up to `batch` waiting messages; True if more are still waiting (call again soon)."""
    for _ in range(batch):
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return False
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:  # EVENTS said readable but the message went (cannot happen on one thread)
            return False
        handle(frames)
    return True
