"""The shared-memory arena: geometry, permissions, read-only attach, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moestream.common.arena import Arena, ArenaError, ArenaView


def test_create_write_attach_read_only_unlink():
    a = Arena.create(3, 8192, mode=0o640)
    try:
        assert a.name.startswith(f"moestream-{os.getpid()}-")
        assert os.stat(a.path).st_size == 3 * 8192
        assert os.stat(a.path).st_mode & 0o777 == 0o640
        a.slot(1)[:5] = b"hello"
        v = ArenaView.attach(a.name, 3, 8192)
        assert bytes(v.slot(1)[:5]) == b"hello" and bytes(v.slot(0)[:5]) == bytes(5)
        with pytest.raises(TypeError):
            v.slot(1)[0] = 1  # read-only mapping
        with pytest.raises(IndexError):
            v.slot(3)
        v.close()
    finally:
        a.close()
    assert not os.path.exists(a.path)


def test_client_exit_does_not_unlink():
    """A process that attached and exited must leave the daemon's segment alone (no resource tracker)."""
    a = Arena.create(1, 4096)
    try:
        code = f"from moestream.common.arena import ArenaView; v = ArenaView.attach({a.name!r}, 1, 4096); print(bytes(v.slot(0)[:1]))"
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)
        assert os.path.exists(a.path)
    finally:
        a.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "moestream-xyz", "moestream-" + "0" * 32, "/dev/shm/moestream-1-" + "0" * 32, 5])
def test_attach_refuses_foreign_names(name):
    with pytest.raises(ArenaError):
        ArenaView.attach(name, 1, 4096)


def test_attach_checks_size_and_geometry():
    a = Arena.create(1, 4096)
    try:
        with pytest.raises(ArenaError, match="expected"):
            ArenaView.attach(a.name, 2, 4096)
        with pytest.raises(ArenaError, match="geometry"):
            ArenaView.attach(a.name, 1, 1000)
    finally:
        a.close()


def test_remove_stale_spares_live_arenas():
    live = Arena.create(1, 4096)
    try:
        # a crashed daemon's segment: right name, nobody holds its lock
        dead = f"/dev/shm/moestream-999999999-{'ab' * 16}"
        fd = os.open(dead, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
        removed = Arena.remove_stale()
        assert os.path.basename(dead) in removed and not os.path.exists(dead)
        assert live.name not in removed
        assert os.path.exists(live.path)
    finally:
        live.close()


def test_close_twice_and_with_slot_views_held():
    """Both sides close cleanly while a caller still holds a slot view; a second close is a no-op."""
    a = Arena.create(2, 4096)
    v = ArenaView.attach(a.name, 2, 4096)
    mine, theirs = a.slot(0), v.slot(1)  # views still exported at close time
    v.close()
    v.close()
    a.close()
    a.close()
    assert not os.path.exists(a.path)
    mine[0] = 7  # the memory lives on with the last view
    assert theirs[0] == 0
