"""llama.cpp, the peer of `moestream bench capped`: llama-cpp-python in a child process of its own
(in its own cgroup, under the same cap), given the plan as one JSON argument; it loads the GGUF
with mmap, evaluates the prompt ids, then one `sample` + `eval` per token (EOS ignored), reads its
disk counters around each part and prints one JSON line.

Extra buffer types (weight repacking, AMX) are off unless asked for, as `llama-cli --no-repack`:
they copy weights into anonymous memory, which defeats mmap under a cap.

The child runs `python -m moestream.decoder.bench.llamacpp_peer SPEC`: it imports neither torch nor
moestream's decoder.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .capped_plan import Plan
from .cgroup_run import CgroupParent, cgroup, failure, last_json, run_watched, usage, wrapped
from .host_counters import Sampler, block_read_bytes, disk_figures, proc_read_bytes

CHILD_MODULE = "moestream.decoder.bench.llamacpp_peer"
PHASES = (("load", "start", "loaded"), ("prefill", "loaded", "prefilled"), ("decode", "prefilled", "done"))


# -- the bench's side ------------------------------------------------------------------------
def llamacpp_spec(plan: Plan) -> dict[str, Any]:
    return {"model": plan.model, "prompt": plan.prompt, "tokens": plan.tokens, "threads": plan.threads,
            "n_ctx": len(plan.prompt) + plan.tokens + 16, "temperature": plan.temperature, "seed": plan.seed,
            "block_stat": str(plan.block_stat) if plan.block_stat else None, "extra_bufts": plan.extra_bufts}


def run_llamacpp(plan: Plan, parent: CgroupParent | None, cap: int | None, tag: str) -> dict[str, Any]:
    """One llama.cpp run in a child process (its own cgroup capped at `cap`, if a parent is given)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"ll-{tag}-", dir=plan.workdir))
    log = run_dir / "llamacpp.log"
    cmd = [sys.executable, "-m", CHILD_MODULE, json.dumps(llamacpp_spec(plan))]
    with cgroup(parent, cap, tag) as group:
        sampler = Sampler(None, {})
        code, out = run_watched(wrapped(group, cmd), plan.env(), plan.timeout_s, log, sampler, "llamacpp")
        if code != 0:
            return {"error": failure("llama.cpp", code, log, group)}
        r = last_json(out)
        decode_tokens = max(0, len(r["tokens"]) - 1)
        return {"decode_tok_s": decode_tokens / r["decode_s"] if r["decode_s"] else None,
                "prefill_s": r["prefill_s"], "decode_s": r["decode_s"], "load_s": r["load_s"],
                "new_tokens": len(r["tokens"]), "tokens": [r["tokens"]],
                **_llamacpp_disk(r["marks"], decode_tokens, plan.disk_counter),
                "peak_llamacpp": sampler.peak.get("llamacpp"), **usage(group)}


def _llamacpp_disk(marks: dict[str, dict[str, int | None]], decode_tokens: int, mode: str) -> dict[str, Any]:
    block = {p: None if marks[a]["block"] is None else marks[b]["block"] - marks[a]["block"] for p, a, b in PHASES}
    own = {p: marks[b]["read_bytes"] - marks[a]["read_bytes"] for p, a, b in PHASES}
    return disk_figures(block, own, decode_tokens, mode)


# -- the child -------------------------------------------------------------------------------
def _no_extra_bufts() -> None:
    """Weights used in place from the mmap, as `llama-cli --no-repack`."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def llamacpp_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in the llama.cpp process: load, prefill, decode; counters read around each part."""
    from .. import OWN_DEFAULTS

    for k in OWN_DEFAULTS:  # the decoder package set them on import here too: llama.cpp at its defaults
        os.environ.pop(k, None)  # (before llama_cpp loads libgomp, which reads them once)
    from llama_cpp import Llama

    if not spec["extra_bufts"]:
        _no_extra_bufts()

    def mark() -> dict[str, int | None]:
        return {"block": block_read_bytes(spec["block_stat"]), "read_bytes": proc_read_bytes("self") or 0}

    def sample() -> int:
        return llm.sample(top_k=0, top_p=1.0, min_p=0.0, temp=spec["temperature"])

    marks = {"start": mark()}
    t0 = time.perf_counter()
    llm = Llama(spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"], n_ctx=spec["n_ctx"],
                n_batch=max(32, len(spec["prompt"])), use_mmap=True, use_mlock=False, verbose=False,
                logits_all=False, seed=spec["seed"])
    t1 = time.perf_counter()
    marks["loaded"] = mark()
    llm.eval(spec["prompt"])
    tokens = [sample()]
    t2 = time.perf_counter()
    marks["prefilled"] = mark()
    for _ in range(spec["tokens"] - 1):  # EOS ignored: every run decodes the same count
        llm.eval([tokens[-1]])
        tokens.append(sample())
    t3 = time.perf_counter()
    marks["done"] = mark()
    return {"load_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2, "tokens": tokens, "marks": marks}


if __name__ == "__main__":
    print(json.dumps(llamacpp_child(json.loads(sys.argv[1]))), flush=True)
