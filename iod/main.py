"""`moestream-iod`: load the model index, create the arena, bind the sockets, serve until SIGTERM.

Exit codes: 0 after a clean SIGTERM/SIGINT drain; 2 a configuration error, found before the
arena exists where it can be (the model file missing, unreadable, not a GGUF or not a MoE
model; a bad option or config file; an endpoint that is not a socket, in a directory that
cannot be made, already served by another daemon, or that cannot be bound; an unknown
socket_group; an arena that does not fit in the memory this process may use: startup.py);
1 a runtime failure (reads, the arena, the loop). One clear line on stderr either way, and
nothing left in /dev/shm or on disk. SIGHUP is logged and
ignored (no config reload: restart). Under systemd, log lines carry journald priorities (logs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import logging
import os
import signal
import sys

import zmq

from moestream.common.arena import MAX_PARTS, Arena, ArenaError
from moestream.common.layout import ModelFormatError, ModelLayout
from moestream.common.units import format_size

from . import logs
from .config import ConfigError, IodConfig, load_config, resolve_slots
from .limits import memory_limit
from .logs import error_line
from .notify import notify
from .readers import Reader, ReadError, open_reader, slot_pieces
from .server import Server
from .startup import check_endpoints, check_group, choose_direct, fit_arena, is_socket, open_model

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
    check_endpoints(cfg)  # before anything is created: a wrong path is a configuration error
    check_group(cfg)
    layout = open_model(cfg.model)
    overhead = own_memory() + OVERHEAD_MARGIN
    limit = memory_limit()
    direct, why = choose_direct(cfg, layout, limit, overhead)
    cfg = dataclasses.replace(cfg, direct=direct)
    slot_bytes = layout.experts.slot_bytes(cfg.direct)
    min_slots = max(MIN_BUDGET_SLOTS, layout.hparams.n_expert_used)
    n_slots = resolve_slots(cfg, slot_bytes, layout.experts.n_blobs, overhead_bytes=overhead, min_slots=min_slots)
    n_slots = fit_arena(cfg, n_slots, slot_bytes, overhead, limit, min(min_slots, n_slots))
    if cfg.memory is not None:
        log.info("memory budget %s: daemon %s (its anonymous memory at start + margin), arena %d slots = %s",
                 format_size(cfg.memory), format_size(overhead), n_slots, format_size(n_slots * slot_bytes))
    with contextlib.ExitStack() as stack:
        # Arena before reader: the reader (closed first) must stop writing before the arena goes.
        for name in Arena.remove_stale():
            log.warning("removed /dev/shm/%s left by a daemon that died without cleaning up", name)
        arena = Arena.create(n_slots, slot_bytes, mode=cfg.socket_mode, group=cfg.socket_group,
                             n_keys=directory_keys(cfg, layout))
        stack.callback(arena.close)
        reader = open_reader([str(f.path) for f in layout.files], backend=cfg.backend,  # one descriptor per part
                             depth=cfg.queue_depth, direct=cfg.direct,
                             ahead_depth=cfg.queue_depth - cfg.reserved(cfg.queue_depth), on_loop=True)
        stack.callback(reader.close)
        if reader.note:
            log.warning("%s", reader.note)
        fixed = _register_arena(reader, arena)
        ctx = zmq.Context()
        stack.callback(ctx.destroy, 200)
        server = Server(cfg, layout, reader, arena, ctx, daemon_bytes=overhead)
        stack.callback(_remove_socket_files, cfg)  # only now: never delete another daemon's files
        _bind(server, cfg)
        log.info("serving %s%s (%d layers x %d experts) on %s: arena %s, %d slots x %d bytes, reader %s %s (%s)%s",
                 layout.path.name, f" and {len(layout.files) - 1} more parts" if len(layout.files) > 1 else "",
                 layout.experts.n_layer, layout.experts.n_expert, cfg.endpoint,
                 arena.name, n_slots, slot_bytes, reader.name,
                 "with O_DIRECT" if direct else "through the page cache", why, fixed)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(server))
        # the loop restored default handlers: a second SIGTERM now must not skip the clean-up
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        log.info("stopped")
    return 0


def _register_arena(reader: Reader, arena: Arena) -> str:
    """Pin the arena's slots with the reader once (io_uring's registered buffers), so no read pins
    its slot's pages again. Returns how reads go, for the log."""
    note = reader.register(slot_pieces(arena.whole(), arena.slot_bytes))
    if note and reader.name == "uring":
        log.warning("%s", note)
    return "" if note else ", READ_FIXED into the registered arena"


def directory_keys(cfg: IodConfig, layout: ModelLayout) -> int:
    """Keys of the arena's directory: every (layer, expert), or 0 for none (turned off, or an
    expert of more parts than a directory entry places)."""
    ex = layout.experts
    if not cfg.directory or len(ex.parts(ex.moe_layers[0], 0)) > MAX_PARTS:
        return 0
    return ex.n_layer * ex.n_expert


def own_memory() -> int:
    """Bytes this process must keep in memory now (before the arena exists): its anonymous pages.
    Its file pages (libpython's, libzmq's, numpy's: ~20 of its ~48 MB resident at start) are
    clean and reclaimable under a memory limit, and it touches few of them while serving (bench
    capped measured its working set at 34-38 MiB); 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
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


def _bind(server: Server, cfg: IodConfig) -> None:
    old = os.umask(0o777 & ~cfg.socket_mode)  # the socket files are born with the right mode
    try:
        server.bind()
    except zmq.ZMQError as e:  # e.g. a tcp port in use, an address not on this host
        raise ConfigError(f"cannot bind {cfg.endpoint} / {cfg.status_endpoint}: {e}") from None
    finally:
        os.umask(old)
    if cfg.socket_group:
        for path in cfg.ipc_paths():
            os.chown(path, -1, grp.getgrnam(cfg.socket_group).gr_gid)


def _remove_socket_files(cfg: IodConfig) -> None:
    for path in cfg.ipc_paths():
        if is_socket(path):  # only ever a socket: never a file that replaced ours meanwhile
            with contextlib.suppress(OSError):
                path.unlink()


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
