"""Compare cache policies on an expert-access trace: decayed LFU, LRU, the two dueling (the
daemon's arena) and Belady's optimum.

A trace is a list of steps; a step is the keys needed together (in practice the routed
`(layer, expert)` pairs of one token). Every policy follows the rule the real caches follow:
all keys of the current step are selected (pinned) before any miss is filled, so a step's
own keys are never evicted while it runs, a key counts as a hit when it is resident at the
start of its step, and a key repeated inside one step counts once; "lfu" and "adaptive" weigh
its repeats as uses (a prompt's tokens routed to it: the daemon's `SlotPolicy.credit`). The
capacity must hold one step's distinct keys. "lfu" runs the real `SlotPolicy`, with one
`step()` per step; "adaptive" the same with `adaptive=True` (it evicts as LRU while a shadow
LRU hits more).

Trace files: see `common.traces` (`generate --trace-out` writes them, `moestream warm` reads them too).

`--per-layer` splits every step into one step per layer (the cache then only has to hold
one layer's experts, and decay ticks per layer instead of per token).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..common.policy import SlotPolicy
from ..common.traces import load_trace

POLICIES = ("lfu", "lru", "adaptive", "belady")
Trace = Sequence[Sequence[Hashable]]


@dataclass(frozen=True)
class SimResult:
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _dedup(trace: Trace) -> list[list[Hashable]]:
    return [list(dict.fromkeys(step)) for step in trace]


def _repeats(trace: Trace) -> list[dict[Hashable, int]]:
    """Per step, the keys it lists more than once and how many times beyond the first."""
    out = []
    for step in trace:
        seen: dict[Hashable, int] = {}
        for key in step:
            seen[key] = seen.get(key, -1) + 1
        out.append({k: n for k, n in seen.items() if n})
    return out


def _need(steps: list[list[Hashable]]) -> int:
    """The least capacity that holds every (deduplicated) step."""
    return max(1, max((len(s) for s in steps), default=0))


def _check_capacity(capacity: int, need: int) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < need:
        raise ValueError(f"capacity {capacity!r} cannot hold one step: need an int >= {need}")


def simulate(trace: Trace, capacity: int, policy: str = "lfu", decay: float = 0.9) -> SimResult:
    """Replay `trace` on a cache of `capacity` slots under `policy` (one of `POLICIES`)."""
    steps = _dedup(trace)
    _check_capacity(capacity, _need(steps))
    return _run(steps, capacity, policy, decay, _repeats(trace))


def _run(steps: list[list[Hashable]], capacity: int, policy: str, decay: float,
         repeats: list[dict[Hashable, int]] | None = None) -> SimResult:
    """`simulate` on steps already deduplicated and checked against `capacity` (`repeats`: the
    uses beyond each key's first, per step)."""
    if policy in ("lfu", "adaptive"):
        return replay(SlotPolicy(capacity, decay, adaptive=policy == "adaptive"), steps, repeats)
    if policy == "lru":
        return _sim_lru(steps, capacity)
    if policy == "belady":
        return _sim_belady(steps, capacity)
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def replay(cache: SlotPolicy, steps: list[list[Hashable]],
           repeats: list[dict[Hashable, int]] | None = None) -> SimResult:
    """`steps` (deduplicated) through `cache`, one `step()` each, with `repeats[s]`'s uses beyond
    the first credited as the daemon does: this replay's hits and misses."""
    hits, misses = cache.hits, cache.misses
    for s, keys in enumerate(steps):
        missed = []
        for key in keys:  # select the hits first, as the caches do
            if cache.lookup(key) is None:
                missed.append(key)
            else:
                cache.pin(key)
        for key in missed:
            cache.insert(key, pin=True)
        for key, n in (repeats[s] if repeats else {}).items():
            cache.credit(key, n)
        for key in keys:
            cache.unpin(key)
        cache.step()
    return SimResult(cache.hits - hits, cache.misses - misses)


def _sim_lru(steps: list[list[Hashable]], capacity: int) -> SimResult:
    cache: OrderedDict[Hashable, None] = OrderedDict()  # least recent first
    hits = misses = 0
    for keys in steps:
        missed = []
        for key in keys:
            if key in cache:
                hits += 1
                cache.move_to_end(key)
            else:
                missed.append(key)
        for key in missed:
            misses += 1
            if len(cache) >= capacity:
                # The step's keys sit at the recent end, so the oldest is never one of them.
                cache.popitem(last=False)
            cache[key] = None
    return SimResult(hits, misses)


def _next_uses(steps: list[list[Hashable]]) -> list[list[float]]:
    """For step s and its j-th key, the index of the next step using that key (inf: never)."""
    later: dict[Hashable, float] = {}
    out: list[list[float]] = [[]] * len(steps)
    for s in range(len(steps) - 1, -1, -1):
        out[s] = [later.get(key, float("inf")) for key in steps[s]]
        for key in steps[s]:
            later[key] = s
    return out


def _sim_belady(steps: list[list[Hashable]], capacity: int) -> SimResult:
    """Evict the resident key, outside the current step, whose next use is farthest away."""
    next_use: dict[Hashable, float] = {}  # resident key -> its next use after the last access
    heap: list[tuple[float, int, Hashable]] = []  # (-next use, seq, key); stale ones skipped
    hits = misses = seq = 0
    for s, (keys, nexts) in enumerate(zip(steps, _next_uses(steps))):
        missed = [k for k in keys if k not in next_use]
        hits += len(keys) - len(missed)
        misses += len(missed)
        for _ in range(len(next_use) + len(missed) - capacity):
            _pop_farthest(heap, next_use, s)
        for key, nxt in zip(keys, nexts):
            next_use[key] = nxt
            seq += 1  # keeps keys out of comparisons: they need not be orderable
            heapq.heappush(heap, (-nxt, seq, key))
    return SimResult(hits, misses)


def _pop_farthest(heap: list, next_use: dict[Hashable, float], s: int) -> None:
    # Resident keys of step s still carry next use == s (set when last accessed) and every
    # other resident key a later one, so they come out last. A key's next uses only grow,
    # so a stale item never matches the key's current value.
    while True:
        neg, _, key = heapq.heappop(heap)
        if next_use.get(key) == -neg:
            assert -neg != s, "a key of the current step was chosen"
            del next_use[key]
            return


# -- trace files -----------------------------------------------------------------------------
def split_per_layer(steps: Trace) -> list[list[tuple[int, int]]]:
    """One step per (token, layer), in layer order within each token."""
    out = []
    for step in steps:
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for key in step:
            by_layer.setdefault(key[0], []).append(key)
        out.extend(by_layer[layer] for layer in sorted(by_layer))
    return out


# -- CLI ---------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moestream simulate",
        description="Hit rates of decayed LFU, LRU, the two dueling (adaptive: moestream-iod's arena) "
                    "and Belady's optimum on an expert trace (.json or .npy; formats in the module "
                    "docstring), each also as a ratio to Belady's.",
        epilog="trace formats:\n"
               '  .json  {"n_layer": L, "n_expert": E, "steps": [[[layer, expert], ...], ...]}\n'
               "  .npy   integer expert ids, shape [tokens, layers, k]; one step per token\n"
               "A step's keys are pinned while it runs, so capacity must hold one step.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="trace file, .json or .npy [tokens, layers, k]")
    p.add_argument("--capacity", type=int, nargs="+", required=True,
                   help="cache size(s) in slots; must hold one step's keys")
    p.add_argument("--decay", type=float, default=0.9, help="LFU score decay per step (0, 1]")
    p.add_argument("--per-layer", action="store_true",
                   help="one step per (token, layer) instead of per token")
    return p


def _report(steps: list[list[Hashable]], repeats: list[dict[Hashable, int]], capacity: int, decay: float) -> str:
    """One capacity's line; `steps` were deduplicated and checked once, by main."""
    res = {name: _run(steps, capacity, name, decay, repeats) for name in POLICIES}
    best = res["belady"].hit_rate

    def ratio(name: str) -> str:
        return f"{res[name].hit_rate / best:.3f}" if best else "n/a"

    online = [name for name in POLICIES if name != "belady"]
    return (f"capacity {capacity}: belady {best:.4f}  " + "  ".join(f"{n} {res[n].hit_rate:.4f}" for n in online)
            + "  " + "  ".join(f"{n}/belady {ratio(n)}" for n in online))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        steps = load_trace(args.trace)
        if args.per_layer:
            steps = split_per_layer(steps)
        steps, repeats = _dedup(steps), _repeats(steps)  # once, for every policy and capacity
        need = _need(steps)
        n_access = sum(len(s) for s in steps)
        n_keys = len({k for s in steps for k in s})
        print(f"{args.trace}: {len(steps)} steps, {n_access} accesses, {n_keys} distinct keys, "
              f"lfu decay {args.decay}")
        for capacity in args.capacity:
            _check_capacity(capacity, need)
            print(_report(steps, repeats, capacity, args.decay))
    except (OSError, ValueError) as exc:
        print(f"policy_sim: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
