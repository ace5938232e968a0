"""llama.cpp, the peer of `moestream bench capped`: llama-cpp-python in a child process of its own
(in its own cgroup, under the same cap), given the plan as one JSON argument; it loads the GGUF
with mmap, evaluates the prompt ids, then one `sample` + `eval` per token (EOS ignored), reads its
disk counters around each part and prints one JSON line.

Extra buffer types (weight repacking, AMX) are off unless asked for, as `llama-cli --no-repack`:
they copy weights into anonymous memory, which defeats mmap under a cap.

Forced routing (a trace [tokens, layers, k], as `generate --force-routing`): llama.cpp's eval
callback asks for every layer's `ffn_moe_topk-L` tensor (the router's selected experts, int32
[k, n_tokens]); once computed, the callback overwrites it with the trace's ids for those tokens'
positions, and the rest of the graph (the expert weights gathered from the router's
probabilities, the expert matmuls) runs on them. The scheduler then computes the graph in
pieces, one per layer: a small cost, shown by the bench beside an unforced run if asked.

The child runs `python -m moestream.decoder.bench.capped.llamacpp_peer SPEC`: it imports neither torch nor
moestream's decoder.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .plan import Plan
from .cgroup_run import CgroupParent, cgroup, failure, last_json, run_watched, usage, wrapped
from .host_counters import Sampler, block_read_bytes, disk_figures, proc_read_bytes

CHILD_MODULE = "moestream.decoder.bench.capped.llamacpp_peer"
PHASES = (("load", "start", "loaded"), ("prefill", "loaded", "prefilled"), ("decode", "prefilled", "done"))


# -- the bench's side ------------------------------------------------------------------------
def llamacpp_spec(plan: Plan) -> dict[str, Any]:
    return {"model": plan.model, "prompt": plan.prompt, "tokens": plan.tokens, "threads": plan.threads,
            "n_ctx": len(plan.prompt) + plan.tokens + 16, "temperature": plan.temperature, "seed": plan.seed,
            "block_stat": str(plan.block_stat) if plan.block_stat else None, "extra_bufts": plan.extra_bufts,
            "force_routing": str(plan.force_routing) if plan.force_routing else None}


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


class _Tensor(ctypes.Structure):
    """The head of ggml.h's `struct ggml_tensor`, up to its name (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS
    64, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class ForcedTopK:
    """llama.cpp's eval callback that overwrites each layer's selected experts with a trace's
    (see the module docstring). The first layer sees every token of a batch; llama.cpp's last
    layer computes only the rows it outputs (the batch's last token, without logits_all), so
    its rows are the batch's last ones. (In a prefill, llama.cpp's last layer therefore fetches
    the last token's experts only; decode steps are one token and route identically.)"""

    PREFIX = b"ffn_moe_topk-"

    def __init__(self, ids: Any):
        self.ids = ids  # [T, L, k] numpy
        self.base = self.batch = self.forced = 0  # position of this batch's first token, its tokens

    def __call__(self, t: int, ask: bool, _user: int) -> bool:
        tensor = _Tensor.from_address(t)
        if not tensor.name.startswith(self.PREFIX):
            return False if ask else True
        if ask:
            return True
        layer = int(tensor.name[len(self.PREFIX):])
        k, n = tensor.ne[0], tensor.ne[1]
        if layer == 0:  # a new batch: every token goes through the first layer
            self.base, self.batch = self.base + self.batch, n
        first = self.base + self.batch - n  # the last layer keeps only the output rows: the batch's last
        for i in range(n):  # rows may be strided (a view of the argsort)
            row = (ctypes.c_int32 * k).from_address(tensor.data + i * tensor.nb[1])
            row[:] = [int(e) for e in self.ids[(first + i) % len(self.ids), layer]]
        self.forced += n
        return True


def _force_routing(path: str) -> ForcedTopK:
    """Install the callback into every context llama-cpp-python creates; the callback object and
    its ctypes wrapper must outlive the context, so both are kept on the returned object."""
    import llama_cpp.llama_cpp as lib
    import numpy as np

    ids = np.load(path, allow_pickle=False)
    cb = ForcedTopK(ids)
    cb.c_fn = lib.ggml_backend_sched_eval_callback(cb)
    default = lib.llama_context_default_params

    def params():
        p = default()
        p.cb_eval, p.cb_eval_user_data = cb.c_fn, None
        return p

    lib.llama_context_default_params = params
    return cb


def llamacpp_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in the llama.cpp process: load, prefill, decode; counters read around each part."""
    from ... import OWN_DEFAULTS

    for k in OWN_DEFAULTS:  # the decoder package set them on import here too: llama.cpp at its defaults
        os.environ.pop(k, None)  # (before llama_cpp loads libgomp, which reads them once)
    if not spec["extra_bufts"]:
        _no_extra_bufts()
    forced = _force_routing(spec["force_routing"]) if spec.get("force_routing") else None
    from llama_cpp import Llama

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
    return {"load_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2, "tokens": tokens, "marks": marks,
            "forced_rows": forced.forced if forced else None}


if __name__ == "__main__":
    print(json.dumps(llamacpp_child(json.loads(sys.argv[1]))), flush=True)
