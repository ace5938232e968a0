"""The decoder's own memory, which under a memory cap the arena goes without.

Measured on a CPU decoder (RssAnon / RssFile, MB) as it starts:

| step                         | anon | file | what                                              |
|------------------------------|-----:|-----:|---------------------------------------------------|
| python + numpy               |   13 |   17 |                                                   |
| import torch                 | +130 |  +63 | Python objects of ~1100 modules; libtorch's text  |
| import numba                 |  +19 |  +96 | llvmlite's LLVM (libllvmlite.so, ~104 MB touched) |
| kernels compiled / loaded    |  +27 |  +12 | the JIT code (loaded: no link modules, jit_cache) |
| dense weights, KV            | +15  |  +17 | (a 512-wide model; scales with the model)         |
| GGUF metadata, 152k vocab    |   +3 |      | gguf-py's reader: +327 to +466 (gguf_fields)      |
| tokenizer, 152k vocab        |  +71 |      | a made vocabulary (124k control tokens), trimmed  |

Once the kernels are compiled or loaded, LLVM is not run again (a new signature would fault its
pages back in), and most of libtorch's text is never touched by a CPU decode. `trim()` pages both
out (MADV_PAGEOUT: clean file pages, dropped now instead of when the cap presses) and returns
freed heap to the system (malloc_trim): about 150 MB fewer resident pages. What a decode touches
comes back on its own (a few MB of libtorch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MADV_PAGEOUT = 21  # Linux >= 5.4
PAGE_OUT = ("libllvmlite", "libtorch_cpu")  # mapped libraries whose pages a decode does not need


@dataclass(frozen=True)
class Memory:
    anon: int  # bytes
    file: int


def own_memory(pid: int | str = "self") -> Memory:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) << 10
    return Memory(fields.get("RssAnon", 0), fields.get("RssFile", 0))


def _mappings(names: tuple[str, ...]) -> list[tuple[int, int]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        f = line.split()
        if len(f) >= 6 and any(n in f[5] for n in names):
            start, end = (int(x, 16) for x in f[0].split("-"))
            out.append((start, end - start))
    return out


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def trim() -> tuple[Memory, Memory]:
    """Page out the libraries a decode does not need and trim the heap; (before, after). Does
    nothing where the C library or the kernel lacks the calls."""
    before = own_memory()
    libc = _libc()
    if libc is None:
        return before, before
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    for start, size in _mappings(PAGE_OUT):
        libc.madvise(start, size, MADV_PAGEOUT)  # EINVAL on an older kernel: nothing paged out
    return before, own_memory()


def advise_random(a: np.ndarray) -> bool:
    """No read-around for page faults in the mapped pages under `a` (MADV_RANDOM): a fault reads
    its own page, not the block device's readahead window around it (8 MB on this VM by default).
    For a table read a row at a time: with the page cache dropped, 100 random 4352-byte rows of a
    640 MiB map read 4.7 MB each without it, 8 KiB with it (this VM, read_ahead_kb 8192). False
    where the call failed."""
    libc = _libc()
    if libc is None or a.size == 0:
        return False
    page = mmap.PAGESIZE
    start = a.ctypes.data // page * page
    end = a.ctypes.data + a.nbytes
    return libc.madvise(start, end - start, mmap.MADV_RANDOM) == 0
