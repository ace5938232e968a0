"""`moestream plan MODEL [--memory SIZE ...] [--probe]`: before a download or a deployment,
what tok/s each memory size should give, how long the arena takes to fill, and the least memory
that runs at all.

The arithmetic (one decoded token, CPU decoder computing from the daemon's arena):

| figure                 | how                                                                           |
|------------------------|-------------------------------------------------------------------------------|
| arena slots            | (memory - decoder - daemon - headroom) // slot bytes, at most every expert    |
| decoder, daemon        | the dense weights but a mapped embedding table + DECODER_BASE_BYTES;          |
|                        | DAEMON_BASE_BYTES (measured defaults)                                         |
| cached share f         | slots / (MoE layers x experts)                                                |
| hit rate h(f)          | the daemon's own policy (`common.policy`: decayed LFU or LRU, uses per token) |
|                        | replayed on --trace, else the --curve's points (published LRU hit rates),     |
|                        | linear between (0, 0), the points and (1, 1)                                  |
| missed bytes / token   | (1 - h) x MoE layers x top-k x mean expert bytes                              |
| I/O s / token          | per MoE layer, its m missed experts (binomial: each of top-k missed with      |
|                        | probability 1 - h) fetched together: the longer of their reads (at the disk's |
|                        | bandwidth for random expert reads with m experts' parts in flight, linear     |
|                        | from one expert's to top-k's; less the k - m hits' compute, which runs        |
|                        | meanwhile: an expert's share of the compute by bytes) and their CPU (m x      |
|                        | --miss-cpu: the daemon works on one miss while the others read; it shares the |
|                        | hits' cores, so nothing hides it). --probe measures both bandwidths (a few    |
|                        | seconds of cold reads through the daemon's own reader: io_uring, O_DIRECT;    |
|                        | the median of 3 rounds), else --bandwidth (stated, at every depth)            |
| compute s / token      | 1 / --compute-tok-s (a measured resident rate), or --probe's: one token       |
|                        | through the CPU kernels on top-k experts of one layer x MoE layers,           |
|                        | the dense bytes at the same rate, LAYER_GLUE_S per layer (stated); else       |
|                        | active bytes / --compute-rate (stated)                                        |
| tok/s                  | 1 / (compute + I/O): no prefetch, a layer's fetch overlaps only its own hits  |
|                        | (forced routing runs so)                                                      |
| prefetched tok/s       | 1 / max(compute + misses x --miss-cpu, missed bytes / the bandwidth at depth  |
|                        | 32): the decoder's prefetch hides reads behind compute and keeps the daemon's |
|                        | queue deep; their CPU then takes the compute's cores                          |
|                        | (measured runs that prefetch land within ~20 % of it, see docs/BENCHMARKS.md) |
| cold fill              | the arena's bytes / the bandwidth at depth 32 (the daemon's batched reads)    |
| least memory           | decoder + daemon + headroom + max(4, top-k) slots                             |
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gguf import GGMLQuantizationType as Q

from ..common.units import format_size

DECODER_BASE_BYTES = 232 << 20  # the decoder's own memory beside its dense weights (torch, numba, KV): 279 MiB
# measured on a 3.2 GiB model with 48.7 MiB of dense weights, 235 on one with 16.8 (peak RssAnon + the file pages it
# touches while decoding, `bench capped`'s warm-up; 336.5 counting every resident file page)
DAEMON_BASE_BYTES = 60 << 20  # what the daemon keeps beside its arena under --memory: its anonymous memory at
# start (~28 MB) + a 32 MiB margin (iod.main.OVERHEAD_MARGIN)
HEADROOM_BYTES = 64 << 20  # kernel, reads in flight
MIN_SLOTS = 4
DEFAULT_BANDWIDTH = 1.0e9  # bytes/s of random expert reads, assumed without --probe
DEFAULT_COMPUTE_RATE = 8.0e9  # bytes/s of quantized weights the CPU kernels get through, assumed: a 2-core
# AVX-512 VM decodes 3.2 GiB of 16 x 64 Q8_0 experts, top-8, resident at 28 tok/s (13 GB/s; 0.5-1 of that for
# the 1-2-bit types, compute-bound)
LAYER_GLUE_S = 0.4e-3  # a decode step's time per layer beside its expert call and dense bytes, assumed:
# 2-core VM, 1024-wide qwen3moe top-8, resident 35.8 ms/token = 16 x 1.7-2.0 ms (the probe's layer call)
# + 3.5 ms (dense bytes at that rate) + ~0.4 ms a layer
MISS_CPU_S = 1.0e-3  # CPU time a missed expert costs, assumed: on the 2-vCPU development VMs the daemon spent
# 0.37-1.05 ms an expert read (its Python: request, read, reply, release) and the decoder ~0.4 ms of its own
# (docs/BENCHMARKS.md, 2026-12-06 (later)); it overlaps the layer's other reads (demand_io_s), and takes the
# decoder's cores from its kernels when prefetched reads hide behind compute
PROBE_ROUNDS = 3  # bandwidth probe rounds, the median reported
DAEMON_DEPTH = 32  # the daemon's reads in flight (moestream-iod --queue-depth) when it fills the arena
DEFAULT_CURVE = "qwen3-235b"
DEFAULT_SIZES = ("25%", "50%", "75%", "100%")


@dataclass(frozen=True)
class Shape:
    """What the forecast needs of a model (from its GGUF header)."""

    moe_layers: int
    n_expert: int
    top_k: int
    expert_bytes: float  # mean blob
    slot_bytes: int
    dense_bytes: int
    file_bytes: int
    parts: int = 3  # byte ranges per expert (gate, up, down; more with biases or scales)
    mapped_bytes: int = 0  # of dense_bytes, an untied quantized embedding table: read a row a token from the file's map

    @property
    def held_dense_bytes(self) -> int:
        """The dense weights the decoder holds and a step reads whole."""
        return self.dense_bytes - self.mapped_bytes

    @property
    def demand_depth(self) -> int:
        """Reads in flight in one layer's demand fetch: its top-k experts' parts."""
        return self.top_k * self.parts

    @property
    def n_blobs(self) -> int:
        return self.moe_layers * self.n_expert

    @property
    def active_bytes(self) -> float:
        """Weight bytes one token's compute reads: its experts and every dense weight."""
        return self.moe_layers * self.top_k * self.expert_bytes + self.held_dense_bytes


@dataclass(frozen=True)
class Forecast:
    memory: int
    slots: int
    cached: float
    hit_rate: float
    missed_bytes_per_token: float
    io_s: float
    compute_s: float
    tok_s: float
    tok_s_prefetched: float
    cold_fill_s: float


def shape_of(layout: Any) -> Shape:
    ex = layout.experts
    return Shape(len(ex.moe_layers), ex.n_expert, layout.hparams.n_expert_used, ex.total_bytes / ex.n_blobs,
                 ex.slot_bytes(True), layout.dense_bytes, layout.file_size, len(ex.parts(ex.moe_layers[0], 0)),
                 _mapped_embedding_bytes(layout))


def _mapped_embedding_bytes(layout: Any) -> int:
    """The embedding table's bytes where the CPU decoder reads it from the file's map (untied and
    block-quantized: `decoder.models.weights.load_dense`), else 0."""
    t = layout.dense.get("token_embd.weight")
    if t is None or "output.weight" not in layout.dense or t.qtype in (Q.F32, Q.F16, Q.BF16):
        return 0
    return t.nbytes


def own_bytes(s: Shape) -> int:
    """The decoder's and the daemon's memory beside the arena, with headroom."""
    return s.held_dense_bytes + DECODER_BASE_BYTES + DAEMON_BASE_BYTES + HEADROOM_BYTES


def least_memory(s: Shape) -> int:
    return own_bytes(s) + max(MIN_SLOTS, s.top_k) * s.slot_bytes


def curve_hit_rate(points: Sequence[tuple[float, float]], f: float) -> float:
    """Linear between (0, 0), the curve's (share cached, hit rate) points and (1, 1)."""
    pts = [(0.0, 0.0), *sorted(points), (1.0, 1.0)]
    f = min(1.0, max(0.0, f))
    for (f0, h0), (f1, h1) in zip(pts, pts[1:]):
        if f <= f1:
            return h0 + (h1 - h0) * (f - f0) / (f1 - f0) if f1 > f0 else h1
    return 1.0


def forecast(s: Shape, memory: int, hit_rate_at, bandwidth: float, compute_s: float,
             fill_bandwidth: float | None = None, miss_cpu_s: float = MISS_CPU_S,
             one_bandwidth: float | None = None) -> Forecast | None:
    """One memory size's forecast (None: too small to run); `hit_rate_at(slots, share)` gives
    the hit rate of an LRU of that many slots."""
    slots = min(s.n_blobs, max(0, memory - own_bytes(s)) // s.slot_bytes)
    if slots < max(MIN_SLOTS, s.top_k):
        return None
    return forecast_slots(s, memory, slots, hit_rate_at(slots, slots / s.n_blobs), bandwidth, compute_s, fill_bandwidth,
                          miss_cpu_s, one_bandwidth)


def forecast_slots(s: Shape, memory: int, slots: int, hit_rate: float, bandwidth: float, compute_s: float,
                   fill_bandwidth: float | None = None, miss_cpu_s: float = MISS_CPU_S,
                   one_bandwidth: float | None = None) -> Forecast:
    """The forecast for an arena of `slots` whose LRU hits `hit_rate` of the experts asked for;
    `bandwidth` at the demand fetch's depth (`one_bandwidth` with one expert's reads in flight:
    `demand_io_s`), `fill_bandwidth` at the daemon's (default the same): the cold fill, and the
    prefetched figure's reads, which the daemon keeps as deep. Each missed expert costs
    `miss_cpu_s` of CPU: within its layer's demand fetch (`demand_io_s`), or, where prefetched
    reads hide behind compute, beside the compute on the same cores. A layer's hits are computed
    while its misses read (`demand_io_s`'s overlap): an expert's share of `compute_s` by bytes."""
    misses = (1.0 - hit_rate) * s.moe_layers * s.top_k  # expert reads a token
    missed = misses * s.expert_bytes
    io = demand_io_s(s, hit_rate, bandwidth, one_bandwidth, miss_cpu_s, compute_s * s.expert_bytes / s.active_bytes)
    deep = fill_bandwidth or bandwidth
    return Forecast(memory, slots, slots / s.n_blobs, hit_rate, missed, io, compute_s, 1.0 / (compute_s + io),
                    1.0 / max(compute_s + misses * miss_cpu_s, missed / deep), slots * s.slot_bytes / deep)


def demand_io_s(s: Shape, hit_rate: float, bandwidth: float, one_bandwidth: float | None = None,
                miss_cpu_s: float = 0.0, expert_compute_s: float = 0.0) -> float:
    """A token's seconds waiting on demand fetches: each MoE layer fetches its m missed experts
    together (m of top-k, each missed with probability 1 - hit_rate: binomial) and waits for the
    longer of
    - their reads: m x the expert's bytes at the bandwidth of m experts' reads in flight, linear
      from `one_bandwidth` (m = 1; None: the same) to `bandwidth` (m = top-k). A layer that misses
      one expert reads at one expert's depth: on the development VM's disk 0.81-0.94 GB/s against
      1.04-1.15 with 12 reads in flight; more on NVMe; less the k - m hits' compute
      (`expert_compute_s` each), which runs meanwhile (the decoder sends the fetch first);
    - their CPU, m x `miss_cpu_s`: the daemon handles one miss while the others read, so the CPU
      adds up only where it outlasts the reads; it shares the cores with the hits' compute, so
      nothing hides it. Added instead, the forecast was 1.42-1.45x too low
      for 3.2 MiB experts (8 a layer, 4 of them missed) and 0.92x for 0.8 MiB ones (1-2 missed):
      with the longer of the two, 0.95-0.97x and 0.81x (docs/BENCHMARKS.md, 2026-12-06 (night)).
    Without the hits' overlap the 40 GiB file's forecast was 0.72-0.78x of its runs once the arena
    kept 0.79 of its experts (docs/BENCHMARKS.md, 2026-12-06 (noon))."""
    k, q = s.top_k, 1.0 - hit_rate
    one = one_bandwidth or bandwidth
    per_layer = 0.0
    for m in range(1, k + 1):
        bw = one + (bandwidth - one) * (m - 1) / (k - 1) if k > 1 else bandwidth
        wait = max(m * s.expert_bytes / bw - (k - m) * expert_compute_s, m * miss_cpu_s, 0.0)
        per_layer += math.comb(k, m) * q ** m * (1.0 - q) ** (k - m) * wait
    return s.moe_layers * per_layer


def trace_hit_rate(path: str, expert_bytes: float):
    """hit_rate_at() from a replay of a routing trace through the daemon's policy (decode steps;
    the first warms it)."""
    from ..common.traces import load_trace
    from ..decoder.bench.capped.routing_replay import arena_policy

    steps = load_trace(path)
    return lambda slots, _f: arena_policy(steps, slots, expert_bytes).get("hit_rate", 0.0)


def probe_bandwidth(layout: Any, seed: int, min_bytes: int, depth: int, direct: bool = True,
                    rounds: int = PROBE_ROUNDS) -> dict[str, Any]:
    """Cold reads of random experts' exact parts, `depth` in flight, through the daemon's own
    reader (io_uring where it works, O_DIRECT as `moestream-iod --direct`): what the daemon's
    misses cost. (A pool of buffered preads measured 0.6-0.7 of it on the development VM's disk.)
    At least `min_bytes` and 4 x `depth` parts a round: with experts of tens of MB a few would never
    fill the depth (a 40 GiB file's 20 MB experts read 1.02 GB/s from 64 MiB, the daemon got 1.46).
    The median of `rounds` rounds, each on other experts: a virtual disk that dips for a second
    (one 256 MiB probe read 0.70 GB/s, the runs after it 2.0) moves one round, not the figure."""
    from ..iod.bench import evict, pick_keys, raw_cold_reads

    ex = layout.experts
    keys, results, n_experts = iter(pick_keys(layout, None, seed)), [], 0
    for _ in range(rounds):
        picked, total, parts = [], 0, 0
        for key in keys:
            picked.append(key)
            total += ex.blob_bytes(key[0])
            parts += len(ex.parts(*key))
            if total >= min_bytes and parts >= 4 * depth:
                break
        if not picked:  # a small model: every expert read already
            break
        n_experts += len(picked)
        evict(layout)
        try:
            results.append(raw_cold_reads(layout, picked, depth, direct, backend="auto"))
        except OSError:  # O_DIRECT refused (tmpfs, some network file systems): the daemon's buffered reads
            if not direct:
                raise
            direct = False
            results.append(raw_cold_reads(layout, picked, depth, direct, backend="auto"))
    rates = sorted(r["bytes"] / r["seconds"] for r in results)
    return {"bytes": sum(r["bytes"] for r in results), "seconds": sum(r["seconds"] for r in results),
            "bytes_per_s": rates[len(rates) // 2], "rounds": [round(x) for x in rates], "depth": depth,
            "reader": results[0]["tool"], "direct": direct, "experts": n_experts}


def probe_compute(layout: Any, groups: int = 6) -> dict[str, Any]:
    """A decode step's compute on this machine, from the file: one token through the CPU kernels
    on top-k experts of the first MoE layer, x the MoE layers, plus the dense weights' bytes at
    the experts' rate and LAYER_GLUE_S per layer for the rest of a step (attention, norms,
    routing, the Python between them). `groups` sets of top-k experts are read in first, then
    each is timed once, in turn, so the bytes come from memory as an arena's do, not from a
    cache that one set fits in (the median)."""
    import statistics
    import time

    import torch

    from ..decoder.experts.resident import QuantResidentExperts
    from ..decoder.numba_setup import warm_kernels

    warm_kernels(lambda _text: None)
    ex, hp = layout.experts, layout.hparams
    layer, k = ex.moe_layers[0], hp.n_expert_used
    x = torch.randn(1, hp.n_embd, generator=torch.Generator().manual_seed(0))  # [1, d]
    weights = torch.full((1, k), 1.0 / k)  # [1, k]
    sets = [(torch.arange(k) + g * k).remainder(ex.n_expert).reshape(1, k) for g in range(groups)]  # [1, k] each
    times = []
    with QuantResidentExperts(layout) as bank:
        for ids in sets:
            bank.mix(layer, x, weights, ids)  # faults the experts in
        for ids in sets:
            t0 = time.perf_counter()
            bank.mix(layer, x, weights, ids)
            times.append(time.perf_counter() - t0)
    layer_s = statistics.median(times)
    rate = k * ex.blob_bytes(layer) / layer_s
    s = shape_of(layout)
    glue = hp.n_layer * LAYER_GLUE_S
    return {"layer_s": layer_s, "bytes_per_s": rate, "glue_s": glue,
            "compute_s": s.moe_layers * layer_s + s.dense_bytes / rate + glue}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("model", help="GGUF MoE file (the first part of a split model: every part is read)")
    a("--memory", action="append", metavar="SIZE", help="memory for daemon + decoder: a size (8GiB) or a share of "
      f"the model file (50%%); repeatable (default {', '.join(DEFAULT_SIZES).replace('%', '%%')})")
    a("--probe", action="store_true", help="measure the disk (a few seconds of cold random expert reads through the "
      "daemon's reader) and the compute (the CPU kernels on one layer's experts)")
    a("--bandwidth", type=float, default=DEFAULT_BANDWIDTH, metavar="BYTES/S",
      help=f"the disk's bandwidth for random expert reads without --probe (default {DEFAULT_BANDWIDTH:.0e})")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--trace", metavar="FILE", help="hit rates from an LRU replay of this routing trace (.json/.npy)")
    g.add_argument("--curve", default=None, help=f"hit rates from a published curve (default {DEFAULT_CURVE}; see "
                   "`authoring.routing_curves`)")
    a("--compute-tok-s", type=float, metavar="TOK/S", help="the decoder's measured resident tok/s (compute only)")
    a("--compute-rate", type=float, default=DEFAULT_COMPUTE_RATE, metavar="BYTES/S",
      help=f"without --compute-tok-s or --probe: weight bytes per second the kernels process (default "
      f"{DEFAULT_COMPUTE_RATE:.0e})")
    a("--miss-cpu", type=float, default=MISS_CPU_S * 1e3, metavar="MS",
      help=f"CPU milliseconds each missed expert costs: the daemon's work for its read and the decoder's own; it "
      "overlaps the layer's other reads, and takes the kernels' cores when prefetched reads hide behind compute "
      f"(default {MISS_CPU_S * 1e3:g}, measured on 2-vCPU VMs; `moestream status` shows a running daemon's ms a read)")
    a("--json", action="store_true", help="one JSON object")
    return p


def plan(args: argparse.Namespace) -> dict[str, Any]:
    from ..authoring.routing_curves import CURVES
    from ..common.layout import ModelLayout
    from ..common.units import parse_size as parse

    if not args.miss_cpu >= 0:  # (before any probe)
        raise ValueError(f"--miss-cpu must be >= 0 ms, got {args.miss_cpu:g}")
    miss_cpu_s = args.miss_cpu / 1e3
    layout = ModelLayout(args.model)
    s = shape_of(layout)
    if args.probe:
        fill = probe_bandwidth(layout, 0, 256 << 20, DAEMON_DEPTH)["bytes_per_s"]
        demand = probe_bandwidth(layout, 1, 64 << 20, s.demand_depth)
        bw = demand["bytes_per_s"]
        one = probe_bandwidth(layout, 2, 32 << 20, s.parts)["bytes_per_s"] if s.demand_depth > s.parts else bw
        bw_basis = (f"measured (--probe, the median of {len(demand['rounds'])} rounds: {demand['reader']}{', O_DIRECT' if demand['direct'] else ''}) with "
                    f"{s.demand_depth} reads in flight; {one / 1e9:.2f} GB/s with one expert's {s.parts}, "
                    f"{fill / 1e9:.2f} with {DAEMON_DEPTH}")
    else:
        bw = fill = one = args.bandwidth
        bw_basis = "assumed (--bandwidth; --probe measures it)"
    if args.compute_tok_s:
        compute_s, c_basis = 1.0 / args.compute_tok_s, f"measured ({args.compute_tok_s} tok/s resident)"
    elif args.probe:
        c = probe_compute(layout)
        compute_s = c["compute_s"]
        c_basis = f"measured (--probe: the CPU kernels on one layer's top-k experts, {c['bytes_per_s'] / 1e9:.1f} GB/s)"
    else:
        compute_s, c_basis = s.active_bytes / args.compute_rate, f"assumed ({args.compute_rate:.2g} B/s of weights)"
    if args.trace:
        hit, h_basis = trace_hit_rate(args.trace, s.expert_bytes), f"LRU replay of {args.trace}"
    else:
        name = args.curve or DEFAULT_CURVE
        if name not in CURVES:
            raise ValueError(f"unknown curve {name!r} (have: {', '.join(CURVES)})")
        hit, h_basis = (lambda _n, f, p=CURVES[name]: curve_hit_rate(p, f)), f"curve {name}" + (
            " (the default)" if args.curve is None else "")
    sizes = [(t, parse(t, percent_of=s.file_bytes)) for t in (args.memory or DEFAULT_SIZES)]
    return {"model": str(layout.path), "shape": asdict(s), "bandwidth": bw, "bandwidth_basis": bw_basis,
            "compute_s": compute_s, "compute_basis": c_basis, "miss_cpu_s": miss_cpu_s, "hit_rate_basis": h_basis,
            "least_memory": least_memory(s), "own_bytes": own_bytes(s),
            "fill_bandwidth": fill, "one_bandwidth": one,
            "forecasts": [{"memory_text": t, "memory": m,
                           **_asdict(forecast(s, m, hit, bw, compute_s, fill, miss_cpu_s, one))} for t, m in sizes]}


def _asdict(f: Forecast | None) -> dict[str, Any]:
    return asdict(f) if f is not None else {"too_small": True}


def report(r: dict[str, Any]) -> str:
    s = r["shape"]
    lines = [f"moestream plan: {r['model']}: {format_size(s['file_bytes'])}, {s['moe_layers']} MoE layers x "
             f"{s['n_expert']} experts (top {s['top_k']}), expert {format_size(round(s['expert_bytes']))}, dense "
             f"{format_size(s['dense_bytes'])}" + (f" ({format_size(s['mapped_bytes'])} of it the embedding table, read "
                                                   "from the file's map)" if s["mapped_bytes"] else ""),
             f"disk {r['bandwidth'] / 1e9:.2f} GB/s {r['bandwidth_basis']}; compute {r['compute_s'] * 1e3:.1f} ms/token "
             f"{r['compute_basis']}, + {r['miss_cpu_s'] * 1e3:g} ms of CPU a missed expert (--miss-cpu); hit rates: "
             f"{r['hit_rate_basis']}",
             f"least memory that runs: {format_size(r['least_memory'])} (decoder + daemon + headroom "
             f"{format_size(r['own_bytes'])} + {max(MIN_SLOTS, s['top_k'])} slots)", "",
             f"{'memory':>10} {'slots':>7} {'cached':>7} {'hit':>6} {'MB/token':>9} {'I/O ms':>8} {'tok/s':>7} "
             f"{'prefetched':>11} {'cold fill s':>12}"]
    for f in r["forecasts"]:
        if f.get("too_small"):
            lines.append(f"{f['memory_text']:>10}   too small: it runs from {format_size(r['least_memory'])}")
            continue
        lines.append(f"{f['memory_text']:>10} {f['slots']:>7} {f['cached']:>7.1%} {f['hit_rate']:>6.2f} "
                     f"{f['missed_bytes_per_token'] / 1e6:>9.2f} {f['io_s'] * 1e3:>8.1f} {f['tok_s']:>7.2f} "
                     f"{f['tok_s_prefetched']:>11.2f} {f['cold_fill_s']:>12.1f}")
    lines.append("tok/s = 1 / (compute + I/O per token): each layer's misses fetched together, the longer of their "
                 "reads (less its hits' compute meanwhile) and their CPU; prefetched = 1 / max(compute + the "
                 "misses' CPU, I/O at depth 32): reads hidden behind compute")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        r = plan(args)
    except (OSError, ValueError) as e:
        print(f"moestream plan: {e}", file=sys.stderr)
        return 1
    print(json.dumps(r, indent=2) if args.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
