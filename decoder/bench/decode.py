"""`moestream bench decode`: decode tok/s with experts streamed vs resident, in one run.

Phases, all on the same prompt, sampling seed and number of tokens:
  resident     every expert in process (the reference and the compute bound);
  working set  streamed, a cache that holds every expert: the streaming overhead
               (goal: >= 0.95 of resident);
  tight        streamed, a cache of --tight (default 25 %) of the experts, prefetch on and off in
               the same run: tok/s beside the bound min(compute, bandwidth / missed bytes per token);
  bandwidth    every expert fetched once more (and copied into a device slot where the format has
               one): expert bytes/s delivered from the daemon to this process, for the bound.
On CUDA two peers are measured in the same run: a device-to-device copy (HBM traffic rate; the
resident bound is that rate / bytes touched per token) and a pinned host -> device copy of the
delivery phase's size (what delivery could reach).
The cache is the daemon's arena with the CPU's 'quant' format (experts computed where they lie:
each streamed phase gets its own daemon with an arena of that many slots), else the decoder's
device slot cache (one daemon for every phase).
Every phase first runs once untimed (warm-up; it also fills the slot caches), then the timed
runs alternate between phases --repeat times; the median tok/s counts (decode steps only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..experts.bank import ExpertBank
    from ..experts.source import ExpertBackend
    from ..experts.prefetch import Prefetcher


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF MoE file")
    p.add_argument("--iod", metavar="ENDPOINT", help="use this running daemon instead of starting one")
    p.add_argument("-n", "--tokens", type=int, default=32, help="tokens decoded per run (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length in tokens (default 16)")
    p.add_argument("--tight", type=float, default=0.25, help="tight cache, as a share of all experts (default 0.25)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="prefetch depth of the 'tight, prefetch' phase (default 1; a 'tight, no prefetch' phase "
                   "always runs beside it; 0 = only that one). On a CPU prefetch did not win on the shipped "
                   "model: a miss costs mostly dequantizing, which prefetch cannot take off the busy cores")
    p.add_argument("--prefetch-at", choices=("layer", "attention"), default=None,
                   help="predict layer L+1 after layer L (more accurate) or after layer L's attention "
                   "(earlier, sent once L's own experts are requested); default: attention with quant, else layer")
    p.add_argument("--landing", choices=("auto", "eager", "lazy"), default="auto",
                   help="prefetched experts land eagerly into a slot on the receiver thread, or lazily from the "
                   "arena when their layer runs (auto: eager on cuda, lazy on cpu)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (default 1.0: varied routing; 0 = greedy)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed and prompt (default 0)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per phase, median reported (default 3)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--slot-format", default="auto", choices=("auto", "quant", "raw"),
                   help="expert format (auto: quant on cpu, raw on cuda); resident uses the same")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice); on a small, "
                   "busy CPU 1 is often fastest, since waiting OMP threads get preempted")
    p.add_argument("--neighbour", action="store_true",
                   help="instead of the phases: resident decode with the default (adapted) thread count against "
                   "every fixed --threads, idle and beside one busy process (decoder/bench/neighbour.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


class Run:
    """The model, prompt and sampling shared by every phase."""

    def __init__(self, args: argparse.Namespace, endpoint: str | None, stack: contextlib.ExitStack):
        from ...common.layout import ModelLayout
        from ..config import DecoderConfig
        from ..models import load_model

        self.args, self.endpoint, self.stack = args, endpoint, stack
        self.last_endpoint = endpoint
        self.cfg = DecoderConfig(model=args.model, prompts=["bench"], iod=endpoint or "spawned", device=args.device,
                                 slot_format=args.slot_format, temperature=args.temperature, seed=args.seed,
                                 max_new_tokens=args.tokens, progress=False)
        self.layout = ModelLayout(args.model)
        self.model = load_model(self.layout, self.cfg.torch_device, self.cfg.torch_dtype,
                                keep_quantized=self.cfg.resolved_slot_format == "quant")
        hp = self.layout.hparams
        self.n_experts = self.layout.experts.n_blobs
        g = torch.Generator().manual_seed(args.seed)
        self.prompt = torch.randint(0, hp.n_vocab, (args.prompt_tokens,), generator=g).tolist()

    def decode(self, bank: ExpertBank, hook: Prefetcher | None = None) -> float:
        """Decode tok/s of one generation (EOS ignored: every run decodes the same count)."""
        from ..generation.loop import generate

        result = generate(self.model.with_bank(bank), [self.prompt], self.args.tokens, self.cfg.sampling, observer=hook,
                          prefill_chunk=self.cfg.prefill_chunk)
        if self.cfg.torch_device.type == "cuda":
            torch.cuda.synchronize(self.cfg.torch_device)
        return result.decode_tok_s()

    @property
    def quant(self) -> bool:
        return self.cfg.resolved_slot_format == "quant"

    def streamed(self, slots: int, prefetch: int) -> tuple[Any, Any, str | None]:
        """(source, prefetch hook, status endpoint of a daemon of its own or None)."""
        from ..experts.prefetch import Prefetcher

        if self.quant:  # the arena is the cache: a daemon with `slots` arena slots
            from ...tools.spawn import spawn_daemon
            from ..experts.arena import open_arena

            daemon = self.stack.enter_context(spawn_daemon(self.args.model, arena_slots=slots))
            source, status = open_arena(self.layout, daemon.endpoint, name="bench-decode"), daemon.status_endpoint
            self.last_endpoint = daemon.endpoint  # the tight cache's daemon: it reads, for the bandwidth
        else:
            from ..experts.gpu.streamed import open_streamed

            landing = None if self.args.landing == "auto" else self.args.landing
            source = open_streamed(self.layout, self.endpoint, device=self.cfg.torch_device,
                                   dtype=self.cfg.torch_dtype, slots=slots,
                                   name="bench-decode", landing=landing)
            status = None
        self.stack.enter_context(source)
        top = self.cfg.prefetch_top
        at = self.args.prefetch_at or self.cfg.resolved_prefetch_at
        hook = Prefetcher(self.model, source, prefetch, top, at) if prefetch else None
        return source, hook, status


class Phase:
    """One expert source under test; `once()` times one generation and accumulates its counters."""

    def __init__(self, run: Run, source: ExpertBackend, hook: Prefetcher | None = None, slots: int = 0, prefetch: int = 0,
                 status: str | None = None):
        from ..experts.bank import ExpertBank

        self.run, self.source, self.hook = run, source, hook
        self.bank = ExpertBank(source)
        self.slots, self.prefetch, self.status = slots, prefetch, status
        self.tok_s: list[float] = []
        self.delta: dict[str, float] = {}
        run.decode(self.bank, hook)  # warm-up, untimed: allocator, kernels, and the slot cache's contents

    def once(self) -> None:
        before = self._counters()
        self.tok_s.append(self.run.decode(self.bank, self.hook))
        for k, v in self._counters().items():
            self.delta[k] = self.delta.get(k, 0) + v - before[k]

    def _counters(self) -> dict[str, float]:
        st = self.bank.stats().as_dict()
        if self.status is not None:  # the arena source: its daemon counts what was read
            from ...tools.status import get_status

            d = get_status(self.status)
            p = st["prefetch"]
            return {"acquired": st["acquired"], "misses": d["reads"], "hits": st["acquired"] - d["reads"],
                    "useful": p["useful"], "hidden": p["hidden"], "bytes_fetched": d["bytes_read"],
                    "stall_s": st["stall_s"], "predicted": p["prefetch_sent"] + p["sent_if_cached"], "predicted_right": p["useful"]}
        keys = ("acquired", "hits", "misses", "useful", "hidden", "bytes_fetched", "stall_s", "predicted",
                "predicted_right")
        return {k: st[k] for k in keys if k in st}

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tok_s": statistics.median(self.tok_s), "runs_tok_s": self.tok_s}
        d = self.delta
        if "misses" not in d:  # resident: no streaming counters
            return out
        tokens = len(self.tok_s) * self.run.args.tokens  # the prefill's expert traffic is counted too
        would_miss = d["misses"] + d["useful"]
        out.update(slots=self.slots, prefetch=self.prefetch, landing=getattr(self.source, "landing", "arena"),
                   prefetch_at=getattr(self.hook, "at", None), hit_rate=max(0.0, d["hits"] / d["acquired"]),
                   missed_bytes_per_token=d["bytes_fetched"] / tokens, stall_s=d["stall_s"],
                   hidden_share=d["hidden"] / would_miss if would_miss else 0.0,
                   prefetch_precision=d["predicted_right"] / d["predicted"] if d["predicted"] else 0.0)
        return out


def make_phases(run: Run, stack: contextlib.ExitStack) -> dict[str, Phase]:
    """Every source at once, so the timed runs can alternate between them (a busy machine's
    load drifts; alternating spreads the drift over all phases instead of biasing one)."""
    cfg, args = run.cfg, run.args
    tight = max(run.layout.hparams.n_expert_used, math.ceil(args.tight * run.n_experts))
    if run.quant:
        from ..experts.resident import QuantResidentExperts

        resident = stack.enter_context(QuantResidentExperts(run.layout))
    else:
        from ..experts.source import ResidentExperts

        resident = stack.enter_context(ResidentExperts(run.layout, cfg.torch_device, cfg.torch_dtype))
    phases = {"resident": Phase(run, resident)}
    plan = [("working_set", run.n_experts, 0), ("tight", tight, args.prefetch)]
    if args.prefetch:
        plan.append(("tight_no_prefetch", tight, 0))
    for name, slots, depth in plan:
        source, hook, status = run.streamed(slots, depth)
        phases[name] = Phase(run, source, hook, slots, depth, status)
    return phases


def phase_bandwidth(run: Run, slot_format: str, endpoint: str) -> dict[str, Any]:
    """Fetch every expert once, layer by layer, and put it into a device slot: expert bytes/s.

    With raw slots this is delivery (daemon -> arena -> device copy); with quant (no slot:
    computed in the arena) it is the daemon's delivery alone."""
    from ...common.client import IodClient
    from ..experts.gpu.slot_cache import DeviceSlotCache

    hp = run.layout.hparams
    cache = DeviceSlotCache(run.layout.experts, hp.n_expert, run.cfg.torch_device,
                            dtype=run.cfg.torch_dtype) if slot_format != "quant" else None
    nbytes = 0
    with IodClient(endpoint, expect_fingerprint=run.layout.fingerprint.as_dict(), name="bench-bw") as client:
        registered = cache is not None and client.arena is not None and cache.register_host(client.arena.whole())
        t0 = time.perf_counter()
        for layer in run.layout.experts.moe_layers:  # (a dense layer has no experts to fetch)
            for e in range(hp.n_expert if cache is not None else 0):
                cache.claim((layer, e))  # evicts the previous layer's copies (unpinned once written)
            for fut in client.fetch([(layer, e) for e in range(hp.n_expert)], "now"):
                lease = fut.result(60)
                key = (lease.layer, lease.expert)
                if cache is not None:
                    cache.write(key, {n: client.part_view(lease, n) for n in lease.parts})
                client.release(lease)
                if cache is not None:
                    cache.unpin(key)
                nbytes += sum(n for _, n in lease.parts.values())
        if run.cfg.torch_device.type == "cuda":
            torch.cuda.synchronize(run.cfg.torch_device)
        seconds = time.perf_counter() - t0
        if cache is not None:
            cache.unregister_host()
    return {"bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds, "host_registered": registered}


def bytes_per_token(run: Run) -> int:
    """Bytes a decode step reads at least: dense weights in the model dtype (one embedding row),
    plus top-k experts per layer as their quantized blobs (KV cache reads left out: short contexts)."""
    lay, hp = run.layout, run.layout.hparams
    tied = "output.weight" not in lay.dense
    dense = sum(math.prod(t.shape) for name, t in lay.dense.items() if tied or not name.startswith("token_embd"))
    layers = lay.experts.n_layer
    per_expert = sum(lay.experts.blob_bytes(i) for i in range(layers)) / layers
    return int(dense * run.cfg.torch_dtype.itemsize + layers * hp.n_expert_used * per_expert)


def _cuda_seconds(device: torch.device, fn: Any, repeat: int) -> float:
    """Seconds per call of `fn` on the device (CUDA events, after one untimed call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / repeat


def _d2d_traffic(dev: torch.device, n: int = 1 << 30) -> float:
    """HBM bytes per second (read + written) of a device-to-device copy of n bytes."""
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    return 2 * n / _cuda_seconds(dev, lambda: dst.copy_(src), 5)


def cuda_peers(run: Run, delivered_bytes: int) -> dict[str, Any]:
    """The same run's hardware peers: device-to-device copy traffic (bytes read + written per
    second) and a pinned host -> device copy of `delivered_bytes` (in chunks of <= 1 GiB)."""
    dev = run.cfg.torch_device
    d2d = _d2d_traffic(dev)
    chunk = max(1, min(int(delivered_bytes), 1 << 30))
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk, dtype=torch.uint8, device=dev)
    repeat = max(1, math.ceil(delivered_bytes / chunk))
    h2d = chunk / _cuda_seconds(dev, lambda: dst.copy_(host, non_blocking=True), repeat)
    touched = bytes_per_token(run)
    return {"d2d_bytes_per_s": d2d, "pinned_h2d_bytes_per_s": h2d, "bytes_per_token": touched,
            "hbm_bound_tok_s": d2d / touched}


def measure(run: Run) -> dict[str, Any]:
    args = run.args
    out: dict[str, Any] = {"model": str(args.model), "device": str(run.cfg.torch_device),
                           "slot_format": run.cfg.resolved_slot_format, "experts": run.n_experts,
                           "tokens": args.tokens, "repeat": args.repeat, "threads": torch.get_num_threads()}
    phases = make_phases(run, run.stack)
    for _ in range(args.repeat):
        for phase in phases.values():
            phase.once()
    out.update({name: phase.result() for name, phase in phases.items()})
    fmt = run.cfg.resolved_slot_format
    endpoint = run.endpoint or run.last_endpoint
    out["delivery"] = phase_bandwidth(run, "quant" if fmt == "quant" else "raw", endpoint)
    out["bandwidth"] = out["delivery"]
    compute = out["resident"]["tok_s"]
    out["working_set"]["ratio"] = out["working_set"]["tok_s"] / compute
    # each streamed run against the resident run just before it: load that drifts over the run
    # moves both of a pair, so these spread less than the two medians do on a noisy machine
    pairs = [s / r for r, s in zip(out["resident"]["runs_tok_s"], out["working_set"]["runs_tok_s"])]
    out["working_set"]["pair_ratios"] = pairs
    out["working_set"]["pair_ratio_median"] = statistics.median(pairs)
    for name in ("tight", "tight_no_prefetch"):
        if name in out:
            add_bound(out[name], compute, out["bandwidth"]["bytes_per_s"])
    if run.cfg.torch_device.type == "cuda":
        peers = out["cuda"] = cuda_peers(run, out["delivery"]["bytes"])
        out["resident"]["ratio_to_hbm_bound"] = compute / peers["hbm_bound_tok_s"]
        out["delivery"]["ratio_to_pinned_h2d"] = out["delivery"]["bytes_per_s"] / peers["pinned_h2d_bytes_per_s"]
    return out


def add_bound(phase: dict[str, Any], compute_tok_s: float, bytes_per_s: float) -> None:
    missed = phase["missed_bytes_per_token"]
    io_bound = bytes_per_s / missed if missed else math.inf
    phase["bound_tok_s"] = min(compute_tok_s, io_bound)
    phase["ratio_to_bound"] = phase["tok_s"] / phase["bound_tok_s"]


def report(r: dict[str, Any]) -> str:
    res, ws, bw, dl = r["resident"], r["working_set"], r["bandwidth"], r["delivery"]
    lines = [f"model {Path(r['model']).name}: {r['experts']} experts, {r['tokens']} tokens x {r['repeat']} runs, "
             f"{r['device']} ({r['threads']} threads), {r['slot_format']} slots",
             f"resident                        {res['tok_s']:8.1f} tok/s",
             f"streamed, cache = working set   {ws['tok_s']:8.1f} tok/s   streamed/resident {ws['ratio']:.3f} "
             f"(goal >= 0.95; median of the {len(ws['pair_ratios'])} run pairs {ws['pair_ratio_median']:.3f}, "
             f"range {min(ws['pair_ratios']):.2f}-{max(ws['pair_ratios']):.2f}), hit rate {ws['hit_rate']:.1%}",
             f"delivery bandwidth              {dl['bytes_per_s'] / 1e6:8.1f} MB/s (every expert: daemon -> "
             f"device slot copy, {dl['bytes'] / 1e6:.1f} MB in {dl['seconds']:.2f} s)",
             f"insert bandwidth ({r['slot_format']:<7} slots) {bw['bytes_per_s'] / 1e6:8.1f} MB/s (the same, into the "
             f"slot format used: the bandwidth in the bound)"]
    for name in ("tight", "tight_no_prefetch"):
        if name in r:
            t = r[name]
            label = "tight, prefetch" if t["prefetch"] else "tight, no prefetch"
            lines.append(
                f"{label:<19} {t['slots']:4d} slots {t['tok_s']:8.1f} tok/s   bound {t['bound_tok_s']:.1f} tok/s = "
                f"min(compute {res['tok_s']:.1f}, {bw['bytes_per_s'] / 1e6:.1f} MB/s / "
                f"{t['missed_bytes_per_token'] / 1e6:.3f} MB missed per token)   tok/s / bound {t['ratio_to_bound']:.3f}"
                f", hit rate {t['hit_rate']:.1%}, misses hidden by prefetch {t['hidden_share']:.1%}"
                f" (prediction precision {t['prefetch_precision']:.1%})")
    if "cuda" in r:
        c = r["cuda"]
        lines.append(f"resident / HBM bound           {res['ratio_to_hbm_bound']:8.3f}   bound {c['hbm_bound_tok_s']:.0f} tok/s "
                     f"= {c['d2d_bytes_per_s'] / 1e9:.0f} GB/s device copy traffic (read + write, this run) / "
                     f"{c['bytes_per_token'] / 1e6:.2f} MB touched per token")
        lines.append(f"delivery / pinned copy         {dl['ratio_to_pinned_h2d']:8.3f}   delivery {dl['bytes_per_s'] / 1e9:.2f} "
                     f"GB/s, pinned host -> device {c['pinned_h2d_bytes_per_s'] / 1e9:.2f} GB/s (same bytes, this run); "
                     f"arena registered with CUDA: {'yes' if dl.get('host_registered') else 'no (pinned staging)'}")
    if "tight_no_prefetch" in r:
        t, n = r["tight"], r["tight_no_prefetch"]
        lines.append(f"prefetch on / off          {t['tok_s'] / n['tok_s']:8.3f}x (depth {t['prefetch']}, predicted after "
                     f"the {t['prefetch_at']}, {t['landing']} landing)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..cli import run_main

    args = build_parser().parse_args(argv)
    return run_main("moestream bench decode", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    _check(args)
    result = _run(args)
    if args.neighbour:
        from .neighbour import report as neighbour_report

        print(json.dumps(result, indent=2) if args.json else neighbour_report(result))
        return 0
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.tokens < 2 or args.repeat < 1 or args.prompt_tokens < 1:
        raise ValueError("--tokens must be >= 2, --repeat and --prompt-tokens >= 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if not 0.0 < args.tight <= 1.0:
        raise ValueError(f"--tight must be in (0, 1], got {args.tight}")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from ..demo import sigterm_as_exit

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    with sigterm_as_exit(), contextlib.ExitStack() as stack:
        run = Run(args, args.iod, stack)
        if args.neighbour:
            from ...common.procfs import available_cpus
            from .neighbour import measure as neighbour

            return neighbour(run, args.threads or available_cpus())
        if args.iod and run.quant:
            raise ValueError("with the 'quant' format each phase needs its own daemon (the arena is the cache), so "
                             "bench decode starts them: drop --iod, or use --slot-format raw")
        if args.iod:
            return measure(run)
        if not run.quant:  # one daemon for every phase's slot cache
            from ...tools.spawn import spawn_daemon

            run.endpoint = stack.enter_context(spawn_daemon(args.model)).endpoint
        return measure(run)
