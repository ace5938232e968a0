"""What a client can tell about a daemon endpoint before and after it goes silent: ZeroMQ
retries an unusable ipc endpoint quietly until a timeout, so these name the actual problem
(permission denied, not a socket, no socket there, which group to join) instead."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path


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
        return f"{head}: there is no socket at {path} (is the daemon running, and is this its endpoint?)" + _dead()
    return f"{head} (is the daemon running, and is this its endpoint?)" + _dead()


def _dead() -> str:
    """What a daemon that died without cleaning up left in /dev/shm, if anything."""
    from .arena import SHM_DIR, dead_arenas
    from .units import format_size

    dead = dead_arenas()
    if not dead:
        return ""
    name, pid, size = dead[-1]
    more = f" (and {len(dead) - 1} more)" if len(dead) > 1 else ""
    return (f"; daemon pid {pid} died without cleaning up: its arena {SHM_DIR}/{name} ({format_size(size)}){more} is "
            "still there (the next daemon start removes it)")


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
