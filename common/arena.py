"""The shared-memory arena: one POSIX shm segment the daemon writes and decoders read.

The daemon creates it (`Arena.create`); a decoder attaches read-only (`ArenaView.attach`) with
its name and geometry from the `welcome` message. Neither side uses
`multiprocessing.shared_memory`: on Python 3.11 it registers every segment with the resource
tracker, which would unlink the daemon's arena when a client exits.
"""

from __future__ import annotations

import fcntl
import grp
import mmap
import os
import re
import uuid

SHM_DIR = "/dev/shm"
NAME_PREFIX = "moestream-"
_NAME_RE = re.compile(r"^moestream-[0-9]+-[0-9a-f]{32}$")  # the only names a client will open


class ArenaError(RuntimeError):
    pass


def dead_arenas() -> list[tuple[str, int, int]]:
    """(name, pid, bytes) of arenas in /dev/shm whose daemon process is gone (killed, OOM): what
    `moestream status` mentions when no daemon answers. Read-only: it takes no lock (that would race
    a daemon creating its arena); the next daemon start removes them (`Arena.remove_stale`)."""
    out = []
    for name in sorted(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else []:
        if not _NAME_RE.match(name):
            continue
        pid = int(name.split("-")[1])
        if os.path.exists(f"/proc/{pid}"):
            continue
        try:
            out.append((name, pid, os.stat(os.path.join(SHM_DIR, name)).st_size))
        except OSError:
            continue
    return out


def _check_geometry(n_slots: int, slot_bytes: int) -> None:
    if n_slots < 1 or slot_bytes < 1 or slot_bytes % mmap.PAGESIZE:
        raise ArenaError(f"bad arena geometry: {n_slots} slots of {slot_bytes} bytes "
                         f"(need >= 1 slot, slot size a multiple of {mmap.PAGESIZE})")


class _Slots:
    """`n_slots` fixed-size slots over one memory map: what the daemon's and a client's side share."""

    def __init__(self, name: str, mm: mmap.mmap, n_slots: int, slot_bytes: int):
        self.name, self.n_slots, self.slot_bytes = name, n_slots, slot_bytes
        self._mm: mmap.mmap | None = mm
        self._view = memoryview(mm)

    def slot(self, i: int) -> memoryview:
        """View of slot i (writable for the daemon's Arena, read-only for an ArenaView)."""
        if not 0 <= i < self.n_slots:
            raise IndexError(f"slot {i} out of range [0, {self.n_slots})")
        return self._view[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def whole(self) -> memoryview:
        """View of every slot at once (slot i's bytes at i * slot_bytes): lets a reader hand one
        buffer and offsets to a kernel that computes over several slots."""
        return self._view[: self.n_slots * self.slot_bytes]

    def _unmap(self) -> bool:
        """Drop the mapping; False when it was already gone."""
        if self._mm is None:
            return False
        self._view.release()
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a slot view; the mapping goes with the last one
            pass
        self._mm = None
        return True


class Arena(_Slots):
    """The daemon's writable arena: `n_slots` fixed-size slots in one shm segment.

    Layout of /dev/shm/moestream-<pid>-<uuid> (`size = n_slots * slot_bytes`, no header: the
    geometry travels in the `welcome` message)::

        offset 0            slot_bytes          2*slot_bytes              (n-1)*slot_bytes
        +-------------------+-------------------+-----------+---------------------------+
        | slot 0            | slot 1            |    ...    | slot n-1                  |
        +-------------------+-------------------+-----------+---------------------------+

        one slot (a blob: an expert's parts; offsets come from `plan_reads` and `ready`):
        +----------------+---pad to 4096---+----------------+---pad---+--------------+----+
        | gate part      |                 | up part        |         | down part    |pad |
        +----------------+-----------------+----------------+---------+--------------+----+
        with O_DIRECT each part is the enclosing 4096-aligned file range, and the part
        starts `offset % 4096` bytes into it.

    A slot's bytes change only while it is not leased to anyone (the host tier guarantees
    that); the generation number in `ready` tells clients which contents they hold.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap, n_slots: int, slot_bytes: int):
        super().__init__(name, mm, n_slots, slot_bytes)
        self._fd = fd

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, *, mode: int = 0o660, group: str | None = None,
               prefault: bool = True) -> Arena:
        """A new segment with a unique name, every page touched once. Its mode is `mode` less any
        write bit but the owner's (0660 -> 0640): the group (decoders) may read the experts and
        never change what the others are served; nobody else may open it."""
        _check_geometry(n_slots, slot_bytes)
        name = f"{NAME_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"  # the pid says whose it is
        path = os.path.join(SHM_DIR, name)
        mode = arena_mode(mode)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            # Held for the daemon's life: a segment nobody holds locked is a crashed daemon's.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise ArenaError(f"{path} was removed while being created")
            os.fchmod(fd, mode)  # umask must not decide who can read the experts
            if group is not None:
                os.fchown(fd, -1, _gid(group))
            os.ftruncate(fd, n_slots * slot_bytes)
            mm = mmap.mmap(fd, n_slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        arena = cls(name, fd, mm, n_slots, slot_bytes)
        if prefault:
            arena._prefault()
        return arena

    @staticmethod
    def remove_stale() -> list[str]:
        """Unlink arenas left by daemons that died without cleaning up (SIGKILL, OOM); returns their names.

        Only this user's segments, and only those no live daemon holds locked."""
        removed = []
        for name in sorted(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else []:
            path = os.path.join(SHM_DIR, name)
            if not _NAME_RE.match(name):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if os.fstat(fd).st_uid != os.geteuid():
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live daemon holds it
            else:
                os.unlink(path)
                removed.append(name)
            finally:
                os.close(fd)
        return removed

    def _prefault(self) -> None:
        # Reserve and touch every page now: the first read into a slot never waits on page
        # faults, and a too-small /dev/shm fails here with a clear error, not SIGBUS later.
        try:
            os.posix_fallocate(self._fd, 0, self.n_slots * self.slot_bytes)
        except OSError as e:
            self.close(unlink=True)
            raise ArenaError(f"cannot allocate {self.n_slots * self.slot_bytes} bytes in {SHM_DIR}: {e.strerror}") from None
        populate = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
        try:
            self._mm.madvise(populate)
        except OSError:
            step = mmap.PAGESIZE
            for off in range(0, len(self._mm), step):
                self._mm[off] = 0

    def close(self, unlink: bool = True) -> None:
        if not self._unmap():
            return
        os.close(self._fd)
        if unlink:  # even with a view still exported: the name goes, the memory with the last view
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ArenaView(_Slots):
    """A client's read-only attachment (no resource tracker: O_RDONLY + PROT_READ mmap)."""

    @classmethod
    def attach(cls, name: str, n_slots: int, slot_bytes: int) -> ArenaView:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ArenaError(f"refusing to attach {name!r}: not a moestream arena name")
        _check_geometry(n_slots, slot_bytes)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ArenaError(f"cannot open arena {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < n_slots * slot_bytes:
                raise ArenaError(f"arena {path} has {size} bytes, expected {n_slots * slot_bytes}")
            mm = mmap.mmap(fd, n_slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        return cls(name, mm, n_slots, slot_bytes)

    def close(self) -> None:
        self._unmap()


def arena_mode(socket_mode: int) -> int:
    """The arena file's mode for a daemon whose sockets get `socket_mode`: owner read-write, the
    group read-only at most, others nothing."""
    return socket_mode & 0o640


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ArenaError(f"unknown group {group!r}") from None
