"""Who the daemon is fair to: peers (a user or a process), not connections, and noticing at once
when a peer process dies.

A connection's peer comes from the kernel (SO_PEERCRED on ipc: `sockets.Peer`), never from
what the client says, so opening more connections buys no more of the arena. `fair_by` says
what one share is:

| fair_by      | one share per                    | tcp connections (no credentials) |
|--------------|----------------------------------|----------------------------------|
| `uid`        | user (the default)               | each its own share               |
| `pid`        | process                          | each its own share               |
| `connection` | connection (the old behaviour)   | each its own share               |

Death: each peer process is watched through a pidfd (readable once the process has exited,
and never confused with a later process that reuses the pid); every connection of a dead
process is dropped with its leases at once, not after `lease_timeout_s`.

Runs on the daemon's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from .sockets import Peer

if TYPE_CHECKING:
    from .clients import ClientState

log = logging.getLogger("moestream.iod")
FAIR_BY = ("uid", "pid", "connection")
ShareKey = tuple  # ("uid", 1000) | ("pid", 4242) | ("connection", identity)


def share_key(fair_by: str, peer: Peer | None, ident: bytes) -> ShareKey:
    if peer is None or fair_by == "connection" or (fair_by == "pid" and peer.pid == 0):
        return ("connection", ident)  # (pid 0: a peer in another pid namespace)
    return ("uid", peer.uid) if fair_by == "uid" else ("pid", peer.pid)


class Shares:
    """The clients of each share, and what the share claims (leases + requests in progress)."""

    def __init__(self) -> None:
        self.members: dict[ShareKey, list[ClientState]] = {}

    def add(self, c: ClientState) -> None:
        self.members.setdefault(c.share, []).append(c)

    def remove(self, c: ClientState) -> None:
        group = self.members.get(c.share, [])
        if c in group:
            group.remove(c)
        if not group:
            self.members.pop(c.share, None)

    def __len__(self) -> int:
        return len(self.members)

    def of(self, c: ClientState) -> list[ClientState]:
        return self.members.get(c.share, [c])

    def claims(self, c: ClientState) -> int:
        return sum(m.claims() for m in self.of(c))



class DeathWatch:
    """Calls `on_exit(pid)` on the loop as soon as a watched process has exited."""

    def __init__(self, on_exit: Callable[[int], None]):
        self.on_exit = on_exit
        self.loop: asyncio.AbstractEventLoop | None = None
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self.polled: set[int] = set()  # pids without a pidfd (old kernel): checked by `poll`

    def watch(self, pid: int) -> None:
        if pid <= 0 or pid == os.getpid() or pid in self._fds or pid in self.polled or self.loop is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            self.loop.call_soon(self.on_exit, pid)
            return
        except (OSError, AttributeError):
            self.polled.add(pid)
            return
        self._fds[pid] = fd
        self.loop.add_reader(fd, self._exited, pid)

    def unwatch(self, pid: int) -> None:
        self.polled.discard(pid)
        fd = self._fds.pop(pid, None)
        if fd is not None:
            if self.loop is not None:
                self.loop.remove_reader(fd)
            os.close(fd)

    def poll(self) -> None:
        for pid in [p for p in self.polled if not os.path.exists(f"/proc/{p}")]:
            self.unwatch(pid)
            self.on_exit(pid)

    def _exited(self, pid: int) -> None:
        self.unwatch(pid)
        self.on_exit(pid)

    def close(self) -> None:
        for pid in list(self._fds):
            self.unwatch(pid)
