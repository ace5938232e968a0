"""Decoder process: torch models whose experts come from moestream-iod or are resident."""

import os

# OpenMP threads (numba's 'omp' layer and torch's) spin a bounded while (GOMP_SPINCOUNT=30000,
# well under a millisecond) when a parallel region ends, then sleep. A decode step runs several
# regions per layer a few hundred microseconds apart: sleeping threads (OMP_WAIT_POLICY=PASSIVE)
# cost a futex wake-up each, ~80 us per region on a 2-core VM, and 2 threads ran slower than 1
# (16-layer Q8_0 qwen3moe, resident, idle: 22.9 tok/s on 2 passive threads, 31.7 on 1, 40.1 on 2
# spinning). Beside a busy process spinning threads collapse (7.2 tok/s on 2): the default thread
# count adapts (kernels/cpu/threads.py) and moves to 1, where no pool thread runs a region (28.0
# tok/s against 32.6 for a fixed 1, 27.2 with passive threads). Read by libgomp when it loads
# (with torch), so it is set here, before any decoder module imports torch; the user's setting
# wins. `OWN_DEFAULTS` lists what was set, so a benchmark can give a peer (llama.cpp, also on
# libgomp) the environment without them (`bench.capped.plan.Plan.env`).
OWN_DEFAULTS: dict[str, str] = {}
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = OWN_DEFAULTS["GOMP_SPINCOUNT"] = "30000"

from .numba_setup import use_writable_cache

use_writable_cache()  # before numba is imported: a read-only install still caches its kernels
