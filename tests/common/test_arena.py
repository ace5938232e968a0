"""The shared-memory arena: geometry, permissions, read-only attach, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
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


def test_directory_publishes_ready_slots_and_every_overwrite_is_seen():
    """The seqlock: a reader finds only complete slots of the key it asks for, and a slot marked
    for rewriting after its lookup (evicted, reloaded, even with the same key) reads as changed."""
    from moestream.common.arena import Directory

    a = Arena.create(3, 4096, n_keys=10)
    try:
        v = ArenaView.attach(a.name, 3, 4096, a.directory_geometry)
        w, r = a.directory, v.directory
        assert r.lookup([4, 7]) == {}  # nothing loaded yet
        w.loading(1, 1, evicted=None)
        assert r.lookup([4, 7]) == {}  # being read: not published
        w.ready(1, 1, 4, [0, 8192, 12288])
        found = r.lookup([4, 7])
        assert list(found) == [4] and found[4][0] == 1 and list(r.slot_offs[1, :3]) == [0, 8192, 12288]
        assert r.moved(found) == [] and r.lookup([1, 4], first=3) == {1: found[4]}  # key 3 + 1
        w.loading(1, 2, evicted=4)  # evicted for another key
        assert r.moved(found) == [4] and r.lookup([4]) == {}
        w.ready(1, 2, 4, [0, 8192, 12288])  # the same key again: a new generation, still a change
        assert r.moved(found) == [4] and list(r.lookup([4])) == [4]
        w.ready(2, 1, 7, [0, 4096, 8192])
        w.loading(2, 2, evicted=None)  # a key whose slot was taken over reads as absent
        assert r.lookup([7]) == {}
        assert Directory.nbytes(10, 3) % 4096 == 0 and os.stat(a.path).st_size == 3 * 4096 + Directory.nbytes(10, 3)
        with pytest.raises(ValueError, match="read-only"):
            r.key_slot[0] = 1  # a decoder cannot change what others read
        v.close()
    finally:
        a.close()


def test_directory_geometry_must_match():
    a = Arena.create(2, 4096, n_keys=5)
    try:
        geo = a.directory_geometry
        for bad in ({**geo, "offset": 4096}, {**geo, "max_parts": 4}, {"offset": geo["offset"]}):
            with pytest.raises(ArenaError, match="directory"):
                ArenaView.attach(a.name, 2, 4096, bad)
        with pytest.raises(ArenaError, match="directory's header"):
            ArenaView.attach(a.name, 2, 4096, {**geo, "n_keys": 4})
    finally:
        a.close()
