"""`moestream bench kernels`: one expert's SwiGLU FFN on its quantized blocks vs dequantize-then-matmul.

For each quant type and rows-per-expert n, times `qkernels.swiglu_expert` (native kernels: fused
below DENSE_MIN_ROWS rows, decode-to-buffer + BLAS from there) against the reference a decoder
would otherwise run: the project's torch `dequantize` of gate, up and down, then F.linear SwiGLU;
and `qkernels.swiglu_experts` computing the whole pool in one call ("1-call", as a layer's experts).
All are timed interleaved, --repeat times, on a pool of --experts distinct random experts copied
to distinct addresses until the pool spans --pool-mib (default 512 MiB, past any last-level cache:
a decode reads its experts from memory, so the 1-bit types, whose 64 experts fit in an L3, are not
held to the cache's speed); medians are reported, per expert, with the quantized
bytes per second the kernel reads, that rate over Q8_0's at the same rows ("x Q8_0"), the
time per weight, and the speed-up of `swiglu_expert` over the reference. "bound" is a streaming
read of the same bytes on the same threads, timed in the same rounds (the memory bandwidth the
kernels are held to, at whatever cache level the pool sits), and "of bound" the 1-call rate over
it. By default every type the CPU kernels decode natively is measured. The int8 types (path
"int8") quantize activations to int8 and dot them in integer arithmetic unless --exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# f16 scale fields set by hand for types `random_blocks` cannot write: byte offset -> value
_SCALES = {"Q5_K": {0: 2e-4, 2: 1e-3}}


def default_types() -> list[str]:
    """Every type with a native CPU kernel, Q8_0 (the ratios' base) first."""
    from ..kernels.cpu.rows import NATIVE

    return ["Q8_0"] + [q.name for q in NATIVE if q.name != "Q8_0"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=None, metavar="QTYPE",
                   help="GGUF quant types (default: every type with a native CPU kernel); types without one "
                   "run the fallback (torch dequantize + matmul) on both sides")
    p.add_argument("--hidden", type=int, default=1024, help="model hidden size d (default 1024)")
    p.add_argument("--expert-ff", type=int, default=1024, help="expert feed-forward size (default 1024)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32], metavar="N",
                   help="tokens routed to the expert, one measurement each (default: 1 4 32)")
    p.add_argument("--repeat", type=int, default=9, help="timed rounds, median reported (default 9)")
    p.add_argument("--experts", type=int, default=4,
                   help="distinct random experts, copied to fill --pool-mib (default 4)")
    p.add_argument("--pool-mib", type=float, default=512.0,
                   help="the copies of the experts span at least this many MiB, timed per round and in one "
                   "call as a layer's experts (default 512: from memory, not a cache); 0: no copies")
    p.add_argument("--threads", type=int, help="kernel and torch threads (default: numba's and torch's own)")
    p.add_argument("--seed", type=int, default=0, help="random weights and activations (default 0)")
    p.add_argument("--exact", action="store_true",
                   help="float32 activations for every type (as MOESTREAM_CPU_EXACT=1); by default the int8 "
                   "types dot int8-quantized activations where the CPU has an integer dot")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def random_matrix(qtype: Any, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """[n_out * row_bytes] uint8 of random blocks that decode to small, finite weights."""
    from gguf import GGML_QUANT_SIZES

    from ...authoring.quantize import ENCODABLE, random_blocks

    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_out * n_in // block
    if qtype in ENCODABLE:
        return random_blocks(n_blocks, qtype, 0.02, rng).reshape(-1)
    if qtype.name not in _SCALES:
        raise ValueError(f"cannot make random {qtype.name} blocks (known: Q5_K and the types "
                         "moestream.authoring.quantize writes)")
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off, value in _SCALES[qtype.name].items():
        blocks[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return blocks.reshape(-1)


def _reference(x, gate, up, down) -> Callable[[], Any]:
    """Dequantize the three matrices with decoder.dequant, then F.linear SwiGLU (the old path)."""
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as Q

    from ..kernels.dequant.blocks import dequantize

    xt = torch.from_numpy(x)  # [n, d]
    parts = [(torch.from_numpy(m.data), Q(m.qtype), (m.n_in, m.n_out)) for m in (gate, up, down)]

    def run() -> Any:
        g, u, d = (dequantize(*p) for p in parts)  # [ff, d], [ff, d], [d, ff]
        return F.linear(F.silu(F.linear(xt, g)) * F.linear(xt, u), d)  # [n, d]

    return run


def _median_ms(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Median ms per call of each of `fns` (each a list of callables run in turn), interleaved."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def measure(qname: str, n: int, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    from gguf import GGMLQuantizationType as Q

    from ..kernels.cpu import ffn as qk
    from ..kernels.cpu.rows import stream_read

    qtype, d, ff = Q[qname], args.hidden, args.expert_ff
    shapes = ((ff, d), (ff, d), (d, ff))  # gate, up, down
    raw = [random_matrix(qtype, *shape, rng) for _ in range(args.experts) for shape in shapes]
    distinct = np.concatenate(raw)  # [bytes] uint8: every expert's parts in one array, as in a file map
    copies = max(1, -(-int(args.pool_mib * 2**20) // distinct.size))
    base = np.tile(distinct, copies)  # [copies * bytes]: the same experts again at new addresses
    ends = np.cumsum([r.size for r in raw * copies])
    mats = [qk.QMatrix(base[end - r.size:end], int(qtype), *shapes[i % 3])
            for i, (r, end) in enumerate(zip(raw * copies, ends))]
    pool = [tuple(mats[i:i + 3]) for i in range(0, len(mats), 3)]
    x = rng.standard_normal((n, d)).astype(np.float32)  # [n, d]
    refs = [_reference(x, *e) for e in pool[:args.experts]]  # the float path, on the distinct experts
    rows = [np.arange(n)] * len(pool)

    def kernel() -> None:
        for e in pool:
            qk.swiglu_expert(x, *e)

    table = qk.expert_table(base, pool)  # (a decoder builds its layer's table once, at load)

    def experts() -> None:  # one call for the whole pool, as a layer's experts
        qk.swiglu_experts(x, table, rows)

    def reference() -> None:
        for r in refs:
            r()

    ro, threads = qk._readonly(base[:base.size // 8 * 8]), qk.get_threads()

    def bound() -> None:  # a streaming read of the same bytes, on the same threads
        stream_read(ro, threads)

    t0 = time.perf_counter()
    qk.swiglu_expert(x, *pool[0])  # loads (or compiles) the kernels
    jit_s = time.perf_counter() - t0
    kernel()  # warm-up
    experts()
    reference()
    bound()
    k_ms, e_ms, r_ms, b_ms = (t / len(p) for t, p in zip(_median_ms([kernel, experts, reference, bound], args.repeat),
                                                            (pool, pool, refs, pool)))
    nbytes = sum(m.nbytes for m in pool[0])
    native = qk.has_kernel(int(qtype))
    path = "fallback" if not native else ("fused" if n < qk.DENSE_MIN_ROWS else "dense")
    if path == "fused" and qk.int8_activations() and qk.has_int_kernel(int(qtype)):
        path = "int8"
    return {"type": qname, "rows": n, "path": path, "ns_per_weight": k_ms * 1e6 / (3 * d * ff),
            "expert_bytes": nbytes, "kernel_ms": k_ms, "reference_ms": r_ms, "gb_per_s": nbytes / k_ms / 1e6,
            "experts_call_ms": e_ms, "experts_gb_per_s": nbytes / e_ms / 1e6,
            "speedup": r_ms / k_ms, "first_call_s": jit_s, "pool_mib": base.size / 2**20, "bound_gb_per_s": nbytes / b_ms / 1e6,
            "of_bound": b_ms / e_ms}


def _table(report: dict[str, Any]) -> str:
    lines = [(f"expert: hidden {report['hidden']}, ff {report['expert_ff']}; pool {report['results'][0]['pool_mib']:.0f} MiB; "
              f"{report['threads']} kernel threads "
              f"({report['threading_layer']}), torch {report['torch_threads']}; median of {report['repeat']}"),
             (f"activations: {'int8 (' + report['int_dot'] + ' dots) for ' if report['int8'] else 'float32'}"
              f"{', '.join(report['int_types']) if report['int8'] else ''}; path 'int8' marks them"),
             f"first call (kernels loaded from numba's cache, or compiled): {report['results'][0]['first_call_s']:.2f} s",
             (f"{'type':<7}{'rows':>5}  {'path':<8}{'kernel ms':>10}{'GB/s':>7}{'x Q8_0':>8}{'ns/weight':>10}"
              f"{'1-call ms':>10}{'GB/s':>7}{'bound':>7}{'of bound':>9}{'dequant+mm ms':>15}{'speed-up':>10}")]
    for r in report["results"]:
        ratio = "-" if r["vs_q8_0"] is None else f"{r['vs_q8_0']:.2f}"
        lines.append(f"{r['type']:<7}{r['rows']:>5}  {r['path']:<8}{r['kernel_ms']:>10.3f}{r['gb_per_s']:>7.2f}"
                     f"{ratio:>8}{r['ns_per_weight']:>10.4f}{r['experts_call_ms']:>10.3f}{r['experts_gb_per_s']:>7.2f}"
                     f"{r['bound_gb_per_s']:>7.2f}{r['of_bound']:>9.2f}"
                     f"{r['reference_ms']:>15.3f}{r['speedup']:>9.2f}x")
    return "\n".join(lines)


def _add_ratios(results: list[dict[str, Any]]) -> None:
    """vs_q8_0: GB/s of quantized bytes over Q8_0's at the same rows (None without a Q8_0 run)."""
    q8 = {r["rows"]: r["gb_per_s"] for r in results if r["type"] == "Q8_0"}
    for r in results:
        r["vs_q8_0"] = r["gb_per_s"] / q8[r["rows"]] if r["rows"] in q8 else None


def _bad_args(args: argparse.Namespace, known_types: set[str]) -> str | None:
    unknown = [t for t in args.types if t not in known_types]
    if unknown:
        return f"unknown quant types {unknown}"
    if min(args.repeat, args.experts, *args.rows) < 1:
        return "--repeat, --experts and --rows must be >= 1"
    if not 0 <= args.pool_mib <= 65536:
        return "--pool-mib must be between 0 and 65536"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.types = args.types or default_types()
    import numba
    import torch
    from gguf import GGMLQuantizationType as Q

    from ..kernels.cpu import ffn as qk
    from ..kernels.cpu.rows_int import INT_TYPES
    from ..kernels.cpu.simd.integer import dot_path

    problem = _bad_args(args, set(Q.__members__))
    if problem:
        print(f"moestream bench kernels: {problem}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    try:
        qk.set_int8_activations(qk.int8_activations() and not args.exact)
        if args.threads:
            qk.set_threads(args.threads)  # ValueError above NUMBA_NUM_THREADS
            torch.set_num_threads(args.threads)
        results = [measure(t, n, args, rng) for t in args.types for n in args.rows]
        _add_ratios(results)
    except ValueError as e:
        print(f"moestream bench kernels: {e}", file=sys.stderr)
        return 2
    report = {"hidden": args.hidden, "expert_ff": args.expert_ff, "repeat": args.repeat,
              "threads": qk.get_threads(), "torch_threads": torch.get_num_threads(),
              "threading_layer": numba.threading_layer(), "dense_min_rows": qk.DENSE_MIN_ROWS,
              "int8": qk.int8_activations(), "int_dot": dot_path(), "int_types": [q.name for q in INT_TYPES],
              "results": results}
    print(json.dumps(report) if args.json else _table(report))
    return 0
