"""The workload of `moestream bench capped` (`--routing`): whose routing both sides decode with.

| --routing     | what decides the experts                                   | sampling | prefetch |
|---------------|------------------------------------------------------------|----------|----------|
| sampled       | the model's router; sampled if greedy routing is narrow    | auto     | 1        |
| chain         | the router of a `make-model --routing chain` model, whose  | greedy   | 1        |
|               | greedy decoding visits a new token every step              |          |          |
| trace FILE    | a trace [tokens, layers, k] (.npy), forced on both sides   | greedy   | 0        |
| curve NAME    | a trace generated to match a published LRU hit-rate curve  | greedy   | 0        |
|               | (`authoring.routing_curves`: qwen3-235b, qwen3.5-397b)     |          |          |

With forced routing the router still runs (same compute) but its picks are replaced; the
prefetcher, which predicts the router's picks, would only fetch wrong experts, so it is off
unless --prefetch says otherwise (an oracle that knows the trace would flatter moestream).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .plan import UsageError

KINDS = ("sampled", "chain", "trace", "curve")


@dataclass(frozen=True)
class Routing:
    kind: str
    arg: str | None = None  # the trace file or the curve name

    @property
    def forced(self) -> bool:
        return self.kind in ("trace", "curve")

    def label(self) -> str:
        return self.kind + (f" {self.arg}" if self.arg else "")


def parse_routing(words: list[str] | None) -> Routing:
    """`--routing KIND [ARG]` -> Routing; UsageError naming what is accepted."""
    words = words or ["sampled"]
    kind, rest = words[0], words[1:]
    if kind not in KINDS:
        raise UsageError(f"--routing {kind!r}: choose one of {', '.join(KINDS)}")
    if kind in ("trace", "curve") and len(rest) != 1:
        raise UsageError(f"--routing {kind} needs one argument ({'FILE.npy' if kind == 'trace' else 'NAME'})")
    if kind in ("sampled", "chain") and rest:
        raise UsageError(f"--routing {kind} takes no argument, got {' '.join(rest)}")
    if kind == "curve":
        from ....authoring.routing_curves import CURVES

        if rest[0] not in CURVES:
            raise UsageError(f"--routing curve {rest[0]!r}: known curves are {', '.join(CURVES)}")
    if kind == "trace" and not Path(rest[0]).is_file():
        raise UsageError(f"--routing trace: file not found: {rest[0]}")
    return Routing(kind, rest[0] if rest else None)


def prepare_trace(routing: Routing, layout: Any, positions: int, seed: int, workdir: Path) -> tuple[Path | None, dict]:
    """The trace file both sides force (None for the router's own routing) and what to say about it."""
    hp = layout.hparams
    if routing.kind == "trace":
        from ...experts.forced import load_forced

        try:
            ids = load_forced(routing.arg, hp)
        except ValueError as e:
            raise UsageError(str(e)) from None
        note = {"trace": routing.arg, "trace_tokens": len(ids)}
        if len(ids) < positions:
            note["wraps"] = f"the trace's {len(ids)} tokens are replayed from the start after position {len(ids)}"
        return Path(routing.arg), note
    if routing.kind == "curve":
        import numpy as np

        from ....authoring.routing_curves import curve_trace, describe

        try:
            ids, fit = curve_trace(routing.arg, hp.n_layer, hp.n_expert, hp.n_expert_used, positions, seed)
        except ValueError as e:
            raise UsageError(str(e)) from None
        path = workdir / f"curve-{routing.arg}.npy"
        np.save(path, ids)
        return path, {"curve": describe(routing.arg, fit)}
    return None, {}


def sampling_for(routing: Routing, requested: str) -> str:
    """The --sampling a workload runs with: greedy for chain (its point) and forced traces."""
    if routing.kind == "sampled":
        return requested
    if requested == "sample":
        raise UsageError(f"--routing {routing.kind} decodes greedily (--sampling sample is for --routing sampled)")
    return "greedy"


def prefetch_for(routing: Routing, requested: int | None) -> int:
    return requested if requested is not None else (0 if routing.forced else 1)
