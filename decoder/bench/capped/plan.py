"""What every run of `moestream bench capped` shares: the caps people type, how one cap is
shared out on the moestream side (decoder + daemon + headroom + arena), and the `Plan` both
sides run from.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ....common.units import format_size, parse_size

MIN_ARENA_SLOTS = 4  # as the daemon's own floor for --memory


class UsageError(ValueError):
    """Bad input or an environment this bench cannot run in: one line, exit code 2."""


def parse_cap(text: str, file_size: int, flag: str = "--memory") -> int:
    """'50%' -> half the model file's size; '1.5GiB' -> bytes (see `parse_size`); UsageError
    naming `flag` otherwise."""
    try:
        cap = parse_size(text, percent_of=file_size)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: {e}") from None
    if cap <= 0:
        raise UsageError(f"{flag} {text!r}: must be > 0")
    return cap


def fmt_bytes(n: float | None) -> str:
    """`format_size` for figures that may be missing ("-") or medians (floats)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    return format_size(round(n))


@dataclass(frozen=True)
class Split:
    """How one cap is shared out on the moestream side."""

    cap: int
    decoder: int  # the decoder process's own memory (measured)
    daemon: int  # the daemon's own memory, without the arena (measured)
    headroom: int  # kernel, page cache of the expert reads in flight
    slot_bytes: int
    daemon_budget: int  # what `moestream-iod --memory` gets: cap - decoder - headroom
    arena_bytes: int  # cap - decoder - daemon - headroom, whole slots
    slots: int

    def describe(self, n_experts: int) -> str:
        return (f"decoder {fmt_bytes(self.decoder)} + daemon {fmt_bytes(self.daemon)} + headroom "
                f"{fmt_bytes(self.headroom)} + arena {fmt_bytes(self.arena_bytes)} = {self.slots} slots of "
                f"{fmt_bytes(self.slot_bytes)} ({self.slots / n_experts:.1%} of the experts)")


def split_budget(cap: int, decoder: int, daemon: int, headroom: int, slot_bytes: int, min_slots: int,
                 max_slots: int, label: str = "") -> Split:
    """Share `cap` out (the arena never holds more than `max_slots`, every expert); UsageError
    naming the numbers when the arena would hold fewer than `min_slots`."""
    left = cap - decoder - daemon - headroom
    slots = min(max_slots, max(0, left) // slot_bytes)
    if slots < min_slots:
        need = decoder + daemon + headroom + min_slots * slot_bytes
        raise UsageError(f"cap {label or fmt_bytes(cap)} = {fmt_bytes(cap)} is too small for moestream: decoder "
                         f"{fmt_bytes(decoder)} + daemon {fmt_bytes(daemon)} + headroom {fmt_bytes(headroom)} + an "
                         f"arena of at least {min_slots} slots of {fmt_bytes(slot_bytes)} = {fmt_bytes(need)}")
    return Split(cap, decoder, daemon, headroom, slot_bytes, cap - decoder - headroom, slots * slot_bytes, slots)


@dataclass
class Plan:
    """What every run shares."""

    model: str
    prompt: list[int]
    tokens: int
    threads: int
    prefetch: int
    temperature: float  # 0 = greedy
    seed: int
    block_stat: Path | None
    workdir: Path
    timeout_s: float
    decoder_args: list[str]
    extra_bufts: bool
    daemon_memory_flag: bool
    disk_counter: str  # auto, block, proc: see `host_counters.disk_figures`
    direct: bool = True  # the daemon reads with O_DIRECT: its reads are not cached beside the arena
    force_routing: Path | None = None  # both sides replay this trace [tokens, layers, k] (--routing trace|curve)
    capped: bool = True  # False (--no-cap): no memory limit, --memory only sizes the daemon
    read_ahead: int | None = None  # KB of block-device readahead for llama.cpp's runs (None: as it is)

    def env(self) -> dict[str, str]:
        """Both sides' environment: the same threads, and none of the decoder package's own
        defaults (its GOMP_SPINCOUNT is not llama.cpp's default; moestream's
        processes set it again themselves)."""
        from ... import OWN_DEFAULTS

        n = str(self.threads)
        env = {k: v for k, v in os.environ.items() if k not in OWN_DEFAULTS}
        return dict(env, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, NUMBA_NUM_THREADS=n, PYTHONUNBUFFERED="1")
