"""What the daemon checks before it creates anything: the model file, the endpoints, the group
and the memory the arena needs. Each problem is a `ConfigError` (exit code 2: a restart cannot
fix it, so systemd's `RestartPreventExitStatus=2` stops the unit instead of looping) with one
line naming the path, the endpoint or the numbers.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import stat
from pathlib import Path

from moestream.common.layout import ModelFormatError, ModelLayout
from moestream.common.units import format_size

from .config import ConfigError, IodConfig, resolve_slots
from .limits import MemoryLimit

log = logging.getLogger("moestream.iod")
GGUF_HEADER_BYTES = 24  # magic, version, tensor count, metadata count

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def open_model(path: Path) -> ModelLayout:
    """The model's layout, or a ConfigError saying what the file is instead of a GGUF MoE model."""
    check_model_file(path)
    try:
        return ModelLayout(path)
    except ModelFormatError as e:
        if "unreadable GGUF header" in str(e):  # what gguf-py says then is numpy's view of the bytes
            raise ConfigError(f"model {path}: its GGUF header or tensor table cannot be read: the file "
                              f"({os.path.getsize(path)} bytes) is truncated or corrupt") from None
        raise ConfigError(str(e)) from None
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:  # the gguf reader's own
        raise ConfigError(f"model {path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                          "is it truncated or still being copied?") from None


def check_model_file(path: Path) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"model {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"model {path}: {e.strerror}") from None
    kind = next((name for test, name in _KINDS if test(st.st_mode)), None)
    if kind is not None:
        raise ConfigError(f"model {path} is {kind}, not a GGUF file")
    try:
        with open(path, "rb") as f:
            head = f.read(GGUF_HEADER_BYTES)
    except OSError as e:
        raise ConfigError(f"model {path}: cannot read it: {e.strerror}") from None
    if head[:4] != b"GGUF":
        raise ConfigError(f"model {path} is not a GGUF file (it starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < GGUF_HEADER_BYTES:
        raise ConfigError(f"model {path} is truncated: {st.st_size} bytes, shorter than a GGUF header")


# -- endpoints -------------------------------------------------------------------------------
def check_endpoints(cfg: IodConfig) -> None:
    """Every ipc endpoint names a socket (stale: removed) or nothing, in a directory that exists
    or can be made; a live socket is another daemon's. Never unlinks anything but a dead socket."""
    for path in cfg.ipc_paths():
        _check_path_kind(path)
        _make_parent(path)
        _clear_stale(path)


def _check_path_kind(path: Path) -> None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # (a parent that cannot be made: `_make_parent` says so)
        return
    except OSError as e:
        raise ConfigError(f"ipc endpoint path {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) \
            else "a regular file" if stat.S_ISREG(st.st_mode) else "not a socket"
        raise ConfigError(f"ipc endpoint path {path} exists and is {kind}, not a socket: "
                          "refusing to replace it (choose another endpoint path or remove it yourself)")


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the socket directory {path.parent} for ipc endpoint {path}: "
                          f"{e.strerror} (create it, or choose an endpoint in a writable directory)") from None


def _clear_stale(path: Path) -> None:
    """Remove a socket file left by a crashed daemon; refuse to steal a live one."""
    if not is_socket(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
        except OSError as e:
            raise ConfigError(f"ipc endpoint {path} exists and is not a usable socket: {e.strerror}") from None
    raise ConfigError(f"another daemon is listening on {path}: stop it, or give this one other endpoints")


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def check_group(cfg: IodConfig) -> None:
    """An unknown socket_group is a configuration error (exit 2: systemd must not restart-loop it)."""
    if cfg.socket_group is None:
        return
    try:
        grp.getgrnam(cfg.socket_group)
    except KeyError:
        raise ConfigError(f"socket_group {cfg.socket_group!r} does not exist: create it (e.g. useradd --system "
                          f"--user-group {cfg.socket_group}), or leave socket_group out to give the sockets "
                          "and the arena the daemon's own group") from None


# -- memory ----------------------------------------------------------------------------------
def fit_arena(cfg: IodConfig, n_slots: int, slot_bytes: int, overhead: int, limit: MemoryLimit,
              min_slots: int) -> int:
    """The slot count to create, checked against what this process may use (its cgroup's limit):
    the default size shrinks to fit, saying so; a size the operator chose that cannot fit is refused
    before any page of the arena exists (else the kernel kills the daemon while it fills it)."""
    fits = max(0, limit.bytes - overhead) // slot_bytes
    if n_slots <= fits:
        return n_slots
    fmt = format_size
    where = f"the memory limit {fmt(limit.bytes)} ({limit.source})"
    chosen = cfg.arena_bytes is not None or cfg.arena_slots is not None or cfg.memory is not None
    if chosen or fits < min_slots:
        what = (f"--memory {fmt(cfg.memory)}" if cfg.memory is not None else
                f"an arena of {n_slots} slots x {fmt(slot_bytes)} = {fmt(n_slots * slot_bytes)}")
        raise ConfigError(f"{what} does not fit in {where}: the daemon itself uses {fmt(overhead)}, which leaves "
                          f"room for {fits} slots (at least {min_slots} needed); size it smaller (e.g. --memory 50%, "
                          "which is of that limit) or raise the limit")
    log.warning("arena sized to fit %s: %d slots x %s = %s instead of the default %d slots", where, fits,
                fmt(slot_bytes), fmt(fits * slot_bytes), n_slots)
    return fits


def choose_direct(cfg: IodConfig, layout: ModelLayout, limit: MemoryLimit, overhead: int) -> tuple[bool, str]:
    """O_DIRECT reads or not, and why: as configured; unset, `auto_direct` on the arena the
    configuration asks for (sized with buffered slots) and whether every part opens with O_DIRECT."""
    if cfg.direct is not None:
        return cfg.direct, "--direct" if cfg.direct else "--no-direct"
    ex = layout.experts
    slot = ex.slot_bytes(False)
    try:
        arena = resolve_slots(cfg, slot, ex.n_blobs, overhead_bytes=overhead) * slot
    except ConfigError:  # (said again, with its numbers, when the arena is sized for real)
        arena = 0
    return auto_direct(ex.total_bytes, limit.bytes, arena, all(_takes_o_direct(f.path) for f in layout.files))


def auto_direct(expert_bytes: int, memory: int, arena: int, direct_ok: bool) -> tuple[bool, str]:
    """O_DIRECT when the page cache could not keep the experts the arena does not (`memory`: the
    memory limit, else physical memory): reads through it would only churn it, and under a cgroup
    limit charge it beside the arena. A 40 GiB file, 24 GiB of RAM, an 8 GiB arena: 1.69 tok/s
    and a 7 s prefill with O_DIRECT, 1.23 and 31 s through the page cache (docs/BENCHMARKS.md)."""
    fmt = format_size
    if expert_bytes <= memory - arena:
        return False, f"automatic: the experts ({fmt(expert_bytes)}) fit in the page cache beside the arena"
    if not direct_ok:
        return False, "automatic: O_DIRECT wanted (the experts do not fit in memory beside the arena), but the file " \
                      "system refuses it"
    return True, (f"automatic: the experts ({fmt(expert_bytes)}) do not fit in the {fmt(max(0, memory - arena))} "
                  "of memory beside the arena")


def _takes_o_direct(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:  # EINVAL: tmpfs and some network or FUSE file systems
        return False
