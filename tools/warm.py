"""`moestream warm`: fill a daemon's host tier with the experts most likely to be used, so the
first request after a (re)start is not a cold start.

Which experts: a routing trace (`generate --trace-out`; the keys most often routed to first) or
the daemon's own hotness history (`--top N`: it keeps request counts on disk across restarts).
How: `ahead` fetches (the priority that never takes the read places or the last free slots that
decoders' `now` requests need), a window of them in flight, each lease released as it lands —
the expert stays cached in the arena, evictable like any other. At most the arena's slot count
is fetched, coldest first, so that if the cache policy must evict while warming (its LRU
tiebreak), the hottest ones are the most recent. No torch: this is a small daemon client.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..common.client import IodClient, IodError, IodRequestError
from ..common.protocol import DEFAULT_ENDPOINT, DEFAULT_STATUS_ENDPOINT, MAX_HOTTEST
from .status import get_status
from ..common.traces import load_trace

Key = tuple[int, int]


def status_beside(endpoint: str) -> str:
    """The status endpoint of the daemon at `endpoint`: `status.sock` in the same run directory, as
    the systemd unit and `spawn_daemon` lay them out (ipc); another transport has to say it."""
    if endpoint == DEFAULT_ENDPOINT:
        return DEFAULT_STATUS_ENDPOINT
    if endpoint.startswith("ipc://") and "/" in endpoint[6:]:
        return endpoint[:endpoint.rindex("/") + 1] + "status.sock"
    raise ValueError(f"--top with --iod {endpoint}: give the daemon's status endpoint too (--status ENDPOINT)")


@dataclass(frozen=True)
class WarmConfig:
    endpoint: str = DEFAULT_ENDPOINT
    trace: str | None = None  # routing trace file (.json from generate --trace-out, or .npy)
    top: int | None = None  # the daemon's N hottest experts (its history)
    status_endpoint: str | None = None  # None: the status socket beside --iod's (status_beside)
    limit: int | None = None  # at most this many experts (default: the arena's slot count)
    in_flight: int = 32  # fetches outstanding at once
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.trace is None) == (self.top is None):
            raise ValueError("choose what to warm: --trace FILE or --top N")
        for name in ("top", "limit", "in_flight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.status_endpoint is None and self.top is not None:
            object.__setattr__(self, "status_endpoint", status_beside(self.endpoint))  # frozen: set once here


@dataclass
class WarmResult:
    requested: int = 0
    warmed: int = 0
    skipped: dict[str, int] | None = None  # error code -> experts the daemon refused
    bytes: int = 0
    seconds: float = 0.0

    @property
    def mb_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def keys_from_trace(path: str) -> list[Key]:
    """Every (layer, expert) of the trace, most often routed to first (rows: a prompt's tokens
    count each; ties: first seen first)."""
    counts: Counter[Key] = Counter()
    for step in load_trace(path):
        counts.update(step)
    return [k for k, _ in counts.most_common()]


def keys_from_history(status_endpoint: str, n: int) -> list[Key]:
    """The daemon's `n` hottest experts, from its request counts (kept across restarts)."""
    status = get_status(status_endpoint, hottest=min(n, MAX_HOTTEST))
    return [(int(layer), int(e)) for layer, e, _count in status["hottest"][:n]]


def warm(client: IodClient, keys: Sequence[Key], in_flight: int = 32, on_done=None) -> WarmResult:
    """Fetch `keys` (`ahead`) in the given order, `in_flight` at a time, releasing each lease as it lands."""
    res, skipped = WarmResult(requested=len(keys)), Counter()
    t0 = time.perf_counter()
    pending: set[cf.Future] = set()
    todo = list(keys)
    while todo or pending:
        while todo and len(pending) < in_flight:
            take, todo = todo[: in_flight - len(pending)], todo[in_flight - len(pending):]
            pending.update(client.fetch(take, priority="ahead"))
        done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
        leases = []
        for f in done:
            try:
                lease = f.result()
            except IodRequestError as e:  # e.g. the arena is busy with decoders' work: they come first
                skipped[e.code] += 1
                continue
            leases.append(lease)
            res.bytes += sum(n for _, n in lease.parts.values())
        if leases:
            client.release_many(leases)
        res.warmed += len(leases)
        if on_done is not None:
            on_done(len(done))
    res.seconds = time.perf_counter() - t0
    res.skipped = dict(skipped)
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream warm", description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--iod", dest="endpoint", default=DEFAULT_ENDPOINT, metavar="ENDPOINT",
                    help=f"the daemon's request endpoint (default {DEFAULT_ENDPOINT})")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--trace", metavar="FILE", help="a routing trace (`moestream generate --trace-out FILE.json`): "
                                                      "its most-used experts first")
    what.add_argument("--top", type=int, metavar="N", help="the daemon's N hottest experts (its request history, "
                                                         "kept across restarts)")
    ap.add_argument("--status", dest="status_endpoint", metavar="ENDPOINT",
                    help="the daemon's status endpoint, for --top (default: status.sock beside --iod's socket, "
                         f"{DEFAULT_STATUS_ENDPOINT} for the default)")
    ap.add_argument("--limit", type=int, metavar="N", help="warm at most N experts (default: the arena's slot count)")
    ap.add_argument("--in-flight", type=int, default=32, metavar="N", help="fetches outstanding at once (default 32)")
    ap.add_argument("--no-progress", action="store_false", dest="progress", default=sys.stderr.isatty(),
                    help="no progress bar (the default when stderr is not a terminal)")
    return ap


def run(cfg: WarmConfig) -> int:
    keys = keys_from_trace(cfg.trace) if cfg.trace else keys_from_history(cfg.status_endpoint, cfg.top)
    if not keys:
        print("moestream warm: nothing to warm (the trace is empty / the daemon has no history yet)", file=sys.stderr)
        return 0
    with IodClient(cfg.endpoint, name="moestream-warm") as client:
        n_slots = int(client.welcome["n_slots"])
        chosen = keys[: min(cfg.limit or n_slots, n_slots)]
        chosen.reverse()  # coldest first: an eviction while warming (LRU tiebreak) then hits the coldest
        from tqdm import tqdm

        with tqdm(total=len(chosen), unit="expert", desc="warming", disable=not cfg.progress, leave=False) as bar:
            res = warm(client, chosen, cfg.in_flight, bar.update)
    skipped = ", ".join(f"{n} {code}" for code, n in sorted(res.skipped.items())) or "none"
    print(f"warmed {res.warmed} of {res.requested} experts ({len(keys)} known, arena {n_slots} slots): "
          f"{res.bytes / 2**20:.1f} MiB in {res.seconds:.2f} s = {res.mb_s:.0f} MB/s; skipped: {skipped}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(WarmConfig(**vars(args)))
    except KeyboardInterrupt:
        print("\nmoestream warm: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, IodError) as e:
        print(f"moestream warm: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
