"""Decoder process: torch models whose experts come from moestream-iod or are resident."""

import os

# OpenMP threads (numba's 'omp' layer and torch's) sleep at once when a parallel region ends
# instead of spinning: beside a busy process a spinning thread burns the time slices its peers
# need, and a region then waits a slice (~ms) for its descheduled thread (2 threads: 9 tok/s
# against 56 with one; passive: no collapse). Read by libgomp when it loads (with torch), so
# it is set here, before any decoder module imports torch; the user's setting wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
