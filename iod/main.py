"""`moestream-iod`: load the model index, create the arena, bind the sockets, serve until SIGTERM.

Exit codes: 0 after a clean SIGTERM/SIGINT drain; 1 fatal runtime error (bad model file,
arena or socket trouble), one clear line on stderr; 2 bad configuration (including an ipc
endpoint path that exists and is not a socket: it is never removed, and a socket_group that
does not exist). Nothing is left in /dev/shm or on disk either way. SIGHUP is logged and
ignored (no config reload: restart). Under systemd, log lines carry journald priorities (logs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path

import zmq

from moestream.common.arena import Arena, ArenaError
from moestream.common.layout import ModelFormatError, ModelLayout
from moestream.common.units import format_size

from . import logs
from .config import ConfigError, IodConfig, load_config, resolve_slots
from .logs import error_line
from .notify import notify
from .readers import ReadError, open_reader
from .server import Server

log = logging.getLogger("moestream.iod")
# What the daemon's own memory grows by after it measured itself at start (reader threads, ZeroMQ
# buffers, latency samples, per-client state); measured growth under load was ~1 MiB.
OVERHEAD_MARGIN = 32 << 20
MIN_BUDGET_SLOTS = 4  # fewer than this (or than a token's top-k) and `--memory` is refused


class FatalError(RuntimeError):
    pass


class Terminated(BaseException):
    """SIGTERM/SIGINT outside the event loop (start-up, clean-up): unwind so the arena is unlinked."""


def _exit_on_signals() -> None:
    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # no reload (see _on_hangup); ignored until the loop logs it


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(error_line(str(e)), file=sys.stderr)
        return 2
    logs.setup(cfg.log_level)
    _exit_on_signals()
    try:
        return run(cfg)
    except Terminated:
        log.info("terminated before serving; cleaned up")
        return 0
    except ConfigError as e:  # found once the model is known, e.g. an arena too small for one slot
        print(error_line(str(e)), file=sys.stderr)
        return 2
    except (ModelFormatError, ArenaError, ReadError, FatalError, OSError, zmq.ZMQError) as e:
        print(error_line(str(e)), file=sys.stderr)
        notify(f"STATUS=failed: {e}")
        return 1


def run(cfg: IodConfig) -> int:
    _check_endpoint_paths(cfg)  # before anything is created: a wrong path is a configuration error
    _check_group(cfg)
    layout = ModelLayout(cfg.model)
    slot_bytes = layout.experts.slot_bytes(cfg.direct)
    overhead = own_memory() + OVERHEAD_MARGIN
    n_slots = resolve_slots(cfg, slot_bytes, layout.experts.n_blobs, overhead_bytes=overhead,
                            min_slots=max(MIN_BUDGET_SLOTS, layout.hparams.n_expert_used))
    if cfg.memory is not None:
        log.info("memory budget %s: daemon %s (measured at start + margin), arena %d slots = %s",
                 format_size(cfg.memory), format_size(overhead), n_slots, format_size(n_slots * slot_bytes))
    with contextlib.ExitStack() as stack:
        # Arena before reader: the reader (closed first) must stop writing before the arena goes.
        for name in Arena.remove_stale():
            log.warning("removed /dev/shm/%s left by a daemon that died without cleaning up", name)
        arena = Arena.create(n_slots, slot_bytes, mode=cfg.socket_mode, group=cfg.socket_group)
        stack.callback(arena.close)
        reader = open_reader([str(f.path) for f in layout.files], backend=cfg.backend,  # one descriptor per part depth=cfg.queue_depth, direct=cfg.direct,
                             ahead_depth=cfg.queue_depth - cfg.reserved(cfg.queue_depth))
        stack.callback(reader.close)
        if reader.note:
            log.warning("%s", reader.note)
        ctx = zmq.Context()
        stack.callback(ctx.destroy, 200)
        server = Server(cfg, layout, reader, arena, ctx, daemon_bytes=overhead)
        _clear_stale_sockets(cfg)
        stack.callback(_remove_socket_files, cfg)  # only now: never delete another daemon's files
        _bind(server, cfg)
        log.info("serving %s%s (%d layers x %d experts) on %s: arena %s, %d slots x %d bytes, reader %s",
                 layout.path.name, f" and {len(layout.files) - 1} more parts" if len(layout.files) > 1 else "",
                 layout.experts.n_layer, layout.experts.n_expert, cfg.endpoint,
                 arena.name, n_slots, slot_bytes, reader.name)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(server))
        # the loop restored default handlers: a second SIGTERM now must not skip the clean-up
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        log.info("stopped")
    return 0


def own_memory() -> int:
    """Bytes this process holds in memory now (resident set, before the arena exists); 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


async def _serve(server: Server) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _on_hangup)
    await server.start_metrics()
    notify(f"READY=1\nSTATUS=serving {server.layout.path.name}\nMAINPID={os.getpid()}")
    serving = loop.create_task(server.serve(stop))
    waiter = loop.create_task(stop.wait())
    await asyncio.wait({waiter, serving}, return_when=asyncio.FIRST_COMPLETED)  # serve may fail first
    notify("STOPPING=1")
    waiter.cancel()
    await serving


def _on_hangup() -> None:
    """SIGHUP (systemctl reload, a closed terminal) is ignored: the model, arena and sockets cannot
    change under connected decoders, so a changed config takes a restart."""
    log.warning("SIGHUP ignored: the configuration is not reloaded; restart the daemon to apply changes")


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:  # uvloop is a dependency on Linux; stay usable without it
        return asyncio.new_event_loop


def _clear_stale_sockets(cfg: IodConfig) -> None:
    for path in cfg.ipc_paths():
        path.parent.mkdir(parents=True, exist_ok=True)
        _clear_stale(path)


def _bind(server: Server, cfg: IodConfig) -> None:
    old = os.umask(0o777 & ~cfg.socket_mode)  # the socket files are born with the right mode
    try:
        server.bind()
    except zmq.ZMQError as e:
        raise FatalError(f"cannot bind {cfg.endpoint} / {cfg.status_endpoint}: {e}") from None
    finally:
        os.umask(old)
    if cfg.socket_group:
        for path in cfg.ipc_paths():
            os.chown(path, -1, grp.getgrnam(cfg.socket_group).gr_gid)


def _check_endpoint_paths(cfg: IodConfig) -> None:
    """An ipc endpoint may only name a socket (stale or live) or nothing: never unlink anything else."""
    for path in cfg.ipc_paths():
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"ipc endpoint path {path}: {e.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) \
                else "a regular file" if stat.S_ISREG(st.st_mode) else "not a socket"
            raise ConfigError(f"ipc endpoint path {path} exists and is {kind}, not a socket: "
                              "refusing to replace it (choose another endpoint path or remove it yourself)")


def _check_group(cfg: IodConfig) -> None:
    """An unknown socket_group is a configuration error (exit 2: systemd must not restart-loop it)."""
    if cfg.socket_group is None:
        return
    try:
        grp.getgrnam(cfg.socket_group)
    except KeyError:
        raise ConfigError(f"socket_group {cfg.socket_group!r} does not exist: create it (e.g. useradd --system "
                          f"--user-group {cfg.socket_group}), or leave socket_group out to give the sockets "
                          "and the arena the daemon's own group") from None


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _clear_stale(path: Path) -> None:
    """Remove a socket file left by a crashed daemon; refuse to steal a live one or touch a non-socket."""
    if not path.exists() and not path.is_symlink():
        return
    if not _is_socket(path):
        raise ConfigError(f"ipc endpoint path {path} exists and is not a socket: refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
        except OSError as e:
            raise FatalError(f"{path} exists and is not a usable socket: {e.strerror}") from None
    raise FatalError(f"another daemon is listening on {path}")


def _remove_socket_files(cfg: IodConfig) -> None:
    for path in cfg.ipc_paths():
        if _is_socket(path):  # only ever a socket: never a file that replaced ours meanwhile
            with contextlib.suppress(OSError):
                path.unlink()


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
