"""The CPU kernels' thread count, adapted between decode steps when the user did not fix it.

On a shared host the best count moves: idle, every core helps a memory-bound kernel; beside one
busy process, a parallel region waits for whichever of its threads was descheduled (a time
slice, ~ms, per region, several regions per layer), and one thread was measured 10x faster than
two. So `ThreadTuner` times each decode step, keeps an average per candidate count (all cores,
half of them, one) and runs the fastest, trying another candidate now and then so it follows a
neighbour that comes or goes (every `explore` steps, less often while the tries lose clearly).
numba's count (the expert, dense and attention kernels: the same bits for any count) follows
the pick, and torch's too for the step's duration only: its few ops left in a decode step's
forward (embedding, glue) give the same bits on any count (tests/decoder/test_threads.py), and
its idle OpenMP threads, spinning beside a busy neighbour, held the default at 0.69 of the best
fixed count, then 0.91-0.94 (Intel VM, `bench decode --neighbour`). Prefill and sampling,
outside the step, keep torch's count as set.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numba
import torch

_ALPHA = 0.3  # weight of a new step time in a candidate's average
_MARGIN = 0.08  # how much faster a smaller count must be to be kept (step times vary with routing)
_LOST = 1.5  # a candidate this much slower than the best lost clearly: try it half as often
_BACKOFF = 16  # at most this many times `explore` steps between tries


class ThreadTuner:
    def __init__(self, most: int, explore: int = 24):
        self.options = sorted({most, max(1, most // 2), 1}, reverse=True)  # [all, half, 1]
        self.explore = explore
        self.avg: dict[int, float] = {}
        self.steps = 0
        # Steps between tries of another count: doubled each time the count tried loses clearly,
        # back to `explore` when one comes close. Beside a busy neighbour a step on two threads
        # of two cores took 74 ms against 9 on one: tried every 24 steps, those tries alone held
        # the default at 0.72 of one thread's tok/s (Intel VM, `bench decode --neighbour`).
        self.interval = explore
        self.next_try = explore - 1
        self.turn = 0
        # The first step is not a sample: it may load a kernel (a float16 KV cache's attention took
        # 60 ms against 11) and it finds the caches cold, which once made the tuner keep one thread.
        # It runs on one thread: the cheap choice beside a busy neighbour, one slower step idle.
        self.unsampled = 1

    def best(self) -> int:
        most = self.options[0]  # fewer threads must win by a margin: idle, all cores is the rule
        return min(self.avg, key=lambda n: self.avg[n] * (1.0 if n == most else 1.0 + _MARGIN))

    def pick(self) -> int:
        """The count for the next step: each candidate once, then the fastest, another now and
        then (in turn) so the tuner follows a neighbour that comes or goes."""
        untried = [n for n in self.options if n not in self.avg]
        if untried:
            return untried[0]
        best = self.best()
        if self.steps >= self.next_try:
            others = [n for n in self.options if n != best]
            return others[self.turn % len(others)]
        return best

    def record(self, threads: int, seconds: float) -> None:
        old = self.avg.get(threads)
        self.avg[threads] = seconds if old is None else (1 - _ALPHA) * old + _ALPHA * seconds
        self.steps += 1
        if len(self.avg) < len(self.options):
            return
        best = self.best()
        if threads != best:  # a try of another count (or the last first one): how it fared sets the next
            lost = seconds > _LOST * self.avg[best]
            self.interval = min(self.interval * 2, _BACKOFF * self.explore) if lost else self.explore
            self.next_try = self.steps + self.interval - 1
            self.turn += 1
        elif self.steps > self.next_try:  # (a try that won became the best)
            self.interval, self.next_try = self.explore, self.steps + self.explore - 1

    @contextmanager
    def step(self):
        """One decode step on the picked count (numba's for this thread, torch's until it ends), timed
        (the first on one thread, not timed)."""
        n = self.options[-1] if self.unsampled else self.pick()
        numba.set_num_threads(n)
        before = torch.get_num_threads()
        torch.set_num_threads(min(n, before))
        t0 = time.perf_counter()
        try:
            yield n
        finally:
            if self.unsampled:
                self.unsampled -= 1
            else:
                self.record(n, time.perf_counter() - t0)
            torch.set_num_threads(before)


_tuner: ThreadTuner | None = None


def adapt(most: int | None) -> None:
    """Adapt numba's count up to `most` between decode steps (None: keep it fixed as set). The
    tuner's averages are kept while `most` stays the same."""
    global _tuner
    if not most or most < 2:
        _tuner = None
    elif _tuner is None or max(_tuner.options) != most:
        _tuner = ThreadTuner(most)


def set_tuner(t: ThreadTuner | None) -> None:
    """Install `t` (or none: fixed counts) as the process's tuner."""
    global _tuner
    _tuner = t


def tuner() -> ThreadTuner | None:
    """The process's tuner, or None when the count is fixed (--threads, NUMBA_NUM_THREADS)."""
    return _tuner


@contextmanager
def decode_step():
    """Wrap one decode step: adapted threads when tuning, else nothing."""
    t = _tuner
    if t is None:
        yield None
        return
    with t.step() as n:
        yield n
