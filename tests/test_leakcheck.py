"""The session leak check notices what a careless test would leave behind."""

import os
import subprocess
import sys
import time
from multiprocessing import shared_memory

from leakcheck import leaked_shm, session_processes, shm_entries


def test_leak_check_sees_segments_and_children():
    """The session leak check (tests/conftest.py) notices what a careless test would leave."""
    before = shm_entries()
    seg = shared_memory.SharedMemory(name=f"moestream-leaktest-{os.getpid()}", create=True, size=4096)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        seg.close()  # unmapped but not unlinked: exactly a leak
        assert leaked_shm(before) == [seg.name]
        assert proc.pid in session_processes()
    finally:
        seg.unlink()
        proc.kill()
        proc.wait()
    assert leaked_shm(before) == [] and proc.pid not in session_processes()


def test_leak_check_sees_an_orphaned_grandchild():
    """A process whose parent died (reparented to init) still counts as this session's."""
    spawn_and_exit = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                      "time.sleep(30)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
    out = subprocess.run([sys.executable, "-c", spawn_and_exit], capture_output=True, text=True, check=True)
    orphan = int(out.stdout)
    try:
        assert orphan in session_processes()
    finally:
        os.kill(orphan, 9)
    for _ in range(100):  # reaped by init, not by us
        if orphan not in session_processes():
            break
        time.sleep(0.05)
    assert orphan not in session_processes()
