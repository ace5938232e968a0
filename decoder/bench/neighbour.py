"""`moestream bench decode --neighbour`: resident decode tok/s with the default thread count
(adapted between steps, `kernels.threads`) against every fixed `--threads`, idle and beside one
busy process (a Python loop spinning on one core, started and stopped by the bench).

In each condition the settings run interleaved (default, 1, 2, ..., then again) --repeat
times after one untimed warm-up each; the median counts. Reported per condition: each
setting's tok/s, the best fixed count, and default / best (goals: >= 0.95 idle, >= 0.8 busy).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

import torch

GOALS = {"idle": 0.95, "busy": 0.8}
_SPIN = "while True: pass"


def _settings(most: int) -> list[int | None]:
    return [None, *range(1, most + 1)]  # None: the default (adapted)


def _use(setting: int | None, most: int, tuner: Any) -> None:
    """As `moestream generate` sets it: --threads N fixes numba's and torch's count, else adapt
    (one tuner per condition, kept across its runs as a process keeps its own)."""
    import numba

    from ..kernels.cpu import threads

    n = most if setting is None else setting
    numba.set_num_threads(n)
    torch.set_num_threads(n)
    threads.set_tuner(tuner if setting is None else None)


def _condition(run: Any, source: Any, most: int, repeat: int) -> dict[str, Any]:
    from ..kernels.cpu.threads import ThreadTuner

    tok_s: dict[str, list[float]] = {}
    tuner = ThreadTuner(most) if most > 1 else None
    for setting in _settings(most):  # warm-up, untimed
        _use(setting, most, tuner)
        run.decode(source)
    for _ in range(repeat):
        for setting in _settings(most):
            _use(setting, most, tuner)
            tok_s.setdefault("default" if setting is None else str(setting), []).append(run.decode(source))
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    fixed = {k: v for k, v in med.items() if k != "default"}
    best = max(fixed, key=fixed.__getitem__)
    return {"tok_s": med, "runs_tok_s": tok_s, "best_fixed": int(best), "default_over_best": med["default"] / fixed[best]}


def measure(run: Any, most: int) -> dict[str, Any]:
    """Both conditions on the resident quant source; the process's thread setting restored."""
    from ..experts.bank import ExpertBank
    from ..experts.resident import QuantResidentExperts

    import numba

    from ..kernels.cpu import threads

    saved = numba.get_num_threads(), torch.get_num_threads(), threads.tuner()
    out: dict[str, Any] = {"model": str(run.args.model), "tokens": run.args.tokens, "repeat": run.args.repeat,
                           "threads_max": most}
    try:
        with ExpertBank(QuantResidentExperts(run.layout)) as source:
            out["idle"] = _condition(run, source, most, run.args.repeat)
            hog = subprocess.Popen([sys.executable, "-c", _SPIN])
            try:
                time.sleep(0.2)  # let it start spinning
                out["busy"] = _condition(run, source, most, run.args.repeat)
            finally:
                hog.kill()
                hog.wait()
    finally:
        numba.set_num_threads(saved[0])
        torch.set_num_threads(saved[1])
        threads.set_tuner(saved[2])
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"model {r['model']}: resident decode, {r['tokens']} tokens x {r['repeat']} runs per setting, "
             f"threads up to {r['threads_max']}; default = adapted between steps"]
    for cond in ("idle", "busy"):
        c = r[cond]
        label = "idle" if cond == "idle" else "beside 1 busy process"
        cells = "  ".join(f"{k}: {v:.1f}" for k, v in c["tok_s"].items())
        lines.append(f"{label:<22} tok/s  {cells}   default / best fixed ({c['best_fixed']}) "
                     f"{c['default_over_best']:.2f} (goal >= {GOALS[cond]})")
    return "\n".join(lines)
