"""Decoder process: torch models whose experts come from moestream-iod or are resident."""

import os

# OpenMP threads (numba's 'omp' layer and torch's) sleep at once when a parallel region ends
# instead of spinning: beside a busy process a spinning thread burns the time slices its peers
# need, and a region then waits a slice (~ms) for its descheduled thread. Measured on 2 cores,
# 16-layer Q8_0 qwen3moe, resident, 2 threads: beside one busy process 20.2 tok/s passive
# against 8.4 spinning (GOMP_SPINCOUNT=30000); idle, passive costs the wake-ups: 23.5 against
# 29 tok/s. Robust first: set GOMP_SPINCOUNT=30000 (or OMP_WAIT_POLICY=ACTIVE) on a machine of
# your own. Read by libgomp when it loads (with torch), so it is set here, before any decoder
# module imports torch; the user's setting wins.
# `OWN_DEFAULTS` lists what was set, so a benchmark can give a peer (llama.cpp, also on libgomp)
# the environment without them (`bench.capped.plan.Plan.env`).
OWN_DEFAULTS: dict[str, str] = {}
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = OWN_DEFAULTS["OMP_WAIT_POLICY"] = "PASSIVE"

from .numba_setup import use_writable_cache

use_writable_cache()  # before numba is imported: a read-only install still caches its kernels
