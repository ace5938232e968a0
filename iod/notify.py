"""sd_notify without a dependency: one datagram to $NOTIFY_SOCKET (systemd Type=notify).

`READY=1` is sent only once the sockets and the arena exist; `STOPPING=1` when draining.
Outside systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("moestream.iod")


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving"); True if a notify socket took it."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), e)
        return False
