"""The session leak check notices what a careless test would leave behind."""

import os
import subprocess
import sys
from multiprocessing import shared_memory

from leakcheck import child_processes, leaked_shm, shm_entries


def test_leak_check_sees_segments_and_children():
    """The session leak check (tests/conftest.py) notices what a careless test would leave."""
    before = shm_entries()
    seg = shared_memory.SharedMemory(name=f"moestream-leaktest-{os.getpid()}", create=True, size=4096)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        seg.close()  # unmapped but not unlinked: exactly a leak
        assert leaked_shm(before) == [seg.name]
        assert proc.pid in child_processes()
    finally:
        seg.unlink()
        proc.kill()
        proc.wait()
    assert leaked_shm(before) == [] and proc.pid not in child_processes()
