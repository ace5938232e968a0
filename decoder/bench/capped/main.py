"""`moestream bench capped`: moestream (daemon + decoder) under one hard memory cap, optionally
beside llama.cpp under the same cap, on the same GGUF file, prompt, token count and threads.

Method
  cap        each --memory is a share of the model FILE's size ("50%") or a size ("1.5GiB"). Every
             run gets a fresh memory cgroup (v2 memory.max, or v1 memory.limit_in_bytes, swap off)
             created under this process's own cgroup (or --cgroup-parent) and removed afterwards.
             Page cache counts against it: that is the point, llama.cpp's mmap competes for the
             same bytes as moestream's arena.
  split      moestream's cap = decoder + daemon + headroom + arena. The decoder's and the daemon's
             own memory (peak RssAnon + the file pages they touched once the daemon served its first
             request: libraries' pages only the load used, such as the JIT compiler's, are
             reclaimable under the cap; the arena's shared memory excluded) are measured in
             an uncapped warm-up run, which also decides the sampling (below). The daemon gets
             `--memory cap - decoder - headroom` (it sizes its arena itself), or, on a daemon
             without --memory, `--arena-bytes` of what is left after its measured use.
  runs       --cold (default) drops the page cache before each run (`sync; echo 3 >
             /proc/sys/vm/drop_caches`). Runs are interleaved: for each repeat, for each cap,
             moestream then llama.cpp, so the machine's drift spreads over both; medians are shown.
  moestream  `moestream-iod --direct` and `moestream generate --prompt-ids ... --json --trace-out` as
             two processes in the run's cgroup. The prompt is --prompt-tokens random ids (--seed).
             The daemon reads with O_DIRECT: with page-cache reads, the model file's pages would be
             charged to the cgroup beside the arena, the same bytes cached twice under one cap
             (--no-direct runs it that way, to compare).
  llama.cpp  llama-cpp-python in its own process and cgroup: `Llama(use_mmap=True)`, `eval` of
             the prompt ids, then one `sample` + `eval` per token (EOS ignored), the same threads.
             Extra buffer types (weight repacking, AMX) are off, as `llama-cli --no-repack`: they
             copy weights into anonymous memory, which defeats mmap under a cap (and the AMX path
             crashed on the development VM); --llamacpp-extra-bufts turns them back on.
  disk       bytes read during the decode steps (load and prefill shown apart), per decoded
             token, from the block device holding the model (/sys/dev/block/MAJ:MIN/stat), which
             counts both sides the same way, or from each side's own processes (/proc/PID/io
             read_bytes: daemon + decoder, or llama.cpp's process, mmap faults included): both are
             shown, --disk-counter picks (auto: the block device unless it saw other processes'
             reads during the run, as on a shared machine). The decode window of moestream's run
             is found by sampling every 5 ms (the daemon's first served request marks the prefill's
             start, plus the decoder's reported prefill time): tens of ms of error at the edges.
             llama.cpp's process reads its counters itself around its loops.
  ideal LRU  moestream's routing trace replayed through an LRU cache of as many experts as the
             capped arena holds (its slot count): missed expert bytes per decoded token; the
             prefill's misses warm the cache but are not counted. disk / ideal LRU says how close
             each side's reads come to that cache; the disk bound is the disk's bandwidth (cold
             reads of random experts through the daemon's own reader, io_uring and O_DIRECT as the
             daemon runs, 32 in flight, measured once in this run) / ideal LRU missed bytes per
             token; each side's bound is min(its uncapped tok/s, with --uncapped, and the disk bound).
  spread     distinct experts per layer over the decode steps. Greedy decoding of a random model
             tends to loop over a few tokens, so the experts touched stay few; if the warm-up's
             spread is under 50 % of the experts (on >= 32 tokens), every run samples instead
             (--temperature, --seed; `--sampling greedy` keeps greedy). The two implementations
             then sample different tokens (different random streams): same distribution, not the
             same text.
  uncapped   --uncapped adds a warm, uncapped phase: `moestream generate --resident` beside
             llama.cpp, tok/s only: compute efficiency without I/O.
  routing    --routing picks the workload (capped/routing.py): sampled (the model's router), chain (a
             `make-model --routing chain` model: greedy decoding visits a new token every step,
             so the routing spreads over the experts), trace FILE.npy or curve NAME (expert ids
             forced on both sides, llama.cpp's through its eval callback; curves are generated
             to match a published LRU hit-rate curve). Each cap shows the ideal LRU's and
             Belady's misses on the run's routing, and the spread.
  readahead  llama.cpp's page faults read what the block device's readahead says: its runs set
             read_ahead_kb to --llamacpp-readahead (128, its best here) and restore it after;
             --llamacpp-default-readahead adds one run at the device's own value as a column.
  no cap     --no-cap: no memory limit on either side (a model bigger than the machine's memory):
             --memory sizes moestream's daemon only, llama.cpp's page cache takes what it can.
  quiet      --quiet-load L waits (at most --quiet-wait s) before each run for the 1-minute load
             to fall below L; each run records its start load, shown beside every run's tok/s.
  forecast   each cap prints `moestream plan`'s arithmetic for its arena beside the measured tok/s:
             the warm-up's routing through the daemon's own policy (decayed LFU) of the arena's
             slots; compute from --compute-tok-s, --uncapped's resident rate, or `plan --probe`'s
             measurement of the CPU kernels on this file (one layer's top-k experts). A run that
             prefetches is set beside plan's "prefetched" figure (reads at the bandwidth with 32 in
             flight, hidden behind compute: 1 / max), a run without (forced routing) beside its
             floor (reads as deep as one layer's demand, then compute: 1 / sum).

Caveats: block-device counters see every process on that disk (the report shows the processes'
own counters beside them); --warm runs under a cap are only meaningful for the arena, since
page-cache pages charged to another cgroup before the run are used without counting against
the cap. The exit code is 2 for bad input or missing cgroups, 1 if any run failed (the report
still shows the rest).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .plan import MIN_ARENA_SLOTS, Plan, Split, UsageError, fmt_bytes, parse_cap, split_budget
from .report import SIDES, any_failed, format_report, medians, ratio, summarize
from .routing import parse_routing, prefetch_for, prepare_trace, sampling_for
from .cgroup_run import CgroupError, CgroupParent, MemoryCgroup, find_cgroup_parent
from .host_counters import ReadAhead, wait_quiet, block_device, drop_caches, evict_file, read_ahead_file
from .llamacpp_peer import run_llamacpp
from .moestream_run import run_moestream
from .routing_replay import arena_policy
from ....tools.plan import (DAEMON_DEPTH, DEFAULT_COMPUTE_RATE, MISS_CPU_S, forecast_slots, probe_bandwidth,
                            probe_compute, shape_of)
from ....common.traces import load_trace

UNCAPPED_FIGURES = ("decode_tok_s", "prefill_s", "error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream bench capped", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", required=True, help="GGUF MoE file")
    a("--memory", action="append", dest="caps", metavar="CAP",
      help="memory cap: a share of the model file (50%%) or a size (1.5GiB); repeat for several caps (default 50%%, "
      "none with --uncapped: then only the uncapped comparison runs)")
    a("--llamacpp", action="store_true", help="run llama.cpp (llama-cpp-python) under the same caps, interleaved")
    a("--uncapped", action="store_true", help="add a warm, uncapped phase: moestream --resident beside llama.cpp")
    a("-n", "--tokens", type=int, default=64, help="tokens generated per run (default 64)")
    a("--prompt-tokens", type=int, default=22, help="prompt length in random token ids (default 22)")
    a("--repeat", type=int, default=2, help="runs per cap and side; medians reported (default 2)")
    a("--threads", type=int, default=2, help="compute threads of each side (default 2)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cold", dest="cold", action="store_true", default=True,
                   help="drop the page cache before every run (default; needs root)")
    g.add_argument("--warm", dest="cold", action="store_false", help="keep the page cache between runs")
    a("--prefetch", type=int, default=None,
      help="moestream's router look-ahead depth (default 1; 0 with forced routing, whose picks it cannot predict)")
    a("--routing", nargs="+", metavar="KIND [ARG]", default=["sampled"],
      help="the workload: sampled (default: the model's router, sampled if its greedy routing is narrow), chain (a "
      "`make-model --routing chain` model decoded greedily: a new token every step), trace FILE.npy (forced expert "
      "ids [tokens, layers, k] on both sides), curve NAME (forced, generated to match a published LRU hit-rate "
      "curve: qwen3-235b, qwen3.5-397b)")
    a("--llamacpp-readahead", type=int, default=128, metavar="KB",
      help="the block device's read_ahead_kb during llama.cpp's runs, restored after (default 128, its best here; "
      "-1: leave it as it is)")
    a("--llamacpp-default-readahead", action="store_true",
      help="also run llama.cpp at the device's own readahead, as a third column (in the first repeat only)")
    a("--quiet-load", type=float, default=None, metavar="LOAD",
      help="before each run, wait (at most --quiet-wait s) for the 1-minute load average to fall below LOAD "
      "(e.g. 0.6); each run records the load it started at")
    a("--quiet-wait", type=float, default=300.0, metavar="S", help="the longest wait for --quiet-load (default 300)")
    a("--compute-tok-s", type=float, default=None, metavar="TOK/S",
      help="the resident tok/s the forecast takes for compute (default: --uncapped's, else plan's assumed rate)")
    a("--no-cap", action="store_true",
      help="no memory limit on either side: --memory then only sizes moestream's daemon (its arena), and llama.cpp "
      "uses the page cache as it likes (a model bigger than the machine's memory)")
    a("--direct", action=argparse.BooleanOptionalAction, default=True,
      help="moestream-iod reads with O_DIRECT (default); --no-direct reads through the page cache, whose pages "
      "are then charged to the cgroup beside the arena (the same bytes cached twice under one cap)")
    a("--sampling", choices=("auto", "greedy", "sample"), default="auto",
      help="auto (default): greedy unless the warm-up's routing is narrow, then sample; or force one")
    a("--temperature", type=float, default=1.0, help="temperature when sampling (default 1.0)")
    a("--seed", type=int, default=0, help="prompt ids and sampling seed (default 0)")
    a("--headroom", default="64MiB",
      help="part of each cap left to the kernel and in-flight page cache (default 64MiB)")
    a("--decoder-arg", action="append", default=[], metavar="ARG",
      help="extra argument for `moestream generate` (repeatable), e.g. --decoder-arg=--slot-format=quant")
    a("--llamacpp-extra-bufts", action="store_true",
      help="let llama.cpp repack weights into extra buffer types (off by default: see above)")
    a("--disk-counter", choices=("auto", "block", "proc"), default="auto",
      help="count disk reads on the block device (block), by each side's own processes (proc: /proc/PID/io), or "
      "auto (default): the block device unless it saw other processes' reads in the run")
    a("--cgroup-parent", metavar="DIR", help="create the runs' cgroups under this cgroup directory (default: this "
      "process's own memory cgroup, v2 if it has the memory controller, else v1)")
    a("--timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)")
    a("--json", action="store_true", help="print one JSON object instead of the tables")
    return p


# -- input -----------------------------------------------------------------------------------
def check_args(args: argparse.Namespace) -> tuple[Any, list[tuple[str, int]], int]:
    """Validate the input; returns (layout, [(cap text, cap bytes)], headroom bytes). UsageError
    otherwise."""
    from ....common.layout import ModelLayout

    if not Path(args.model).is_file():
        raise UsageError(f"model not found: {args.model}")
    if args.tokens < 2 or args.prompt_tokens < 1 or args.repeat < 1 or args.threads < 1 or (args.prefetch or 0) < 0:
        raise UsageError("-n must be >= 2, --prompt-tokens, --repeat and --threads >= 1, --prefetch >= 0")
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be > 0 (greedy is --sampling greedy), got {args.temperature}")
    args.routing = parse_routing(args.routing)
    args.sampling = sampling_for(args.routing, args.sampling)
    args.prefetch = prefetch_for(args.routing, args.prefetch)
    layout = ModelLayout(args.model)
    caps = [(text, parse_cap(text, layout.file_size)) for text in (args.caps or ([] if args.uncapped else ["50%"]))]
    for text, cap in caps:
        if cap <= layout.dense_bytes:
            raise UsageError(f"cap {text} = {fmt_bytes(cap)} is smaller than the model's dense weights alone "
                             f"({fmt_bytes(layout.dense_bytes)} of a {fmt_bytes(layout.file_size)} file)")
    headroom = parse_cap(args.headroom, layout.file_size, "--headroom")
    if args.llamacpp and importlib.util.find_spec("llama_cpp") is None:
        raise UsageError("--llamacpp needs llama-cpp-python: pip install 'moestream[bench]'")
    return layout, caps, headroom


def _help_lacks(module: str, flags: Sequence[str]) -> list[str]:
    """Which of `flags` the module's --help lacks."""
    text = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                          check=False).stdout
    return [f for f in flags if f not in text]


def make_plan(args: argparse.Namespace, layout: Any, workdir: Path) -> Plan:
    missing = _help_lacks("moestream.decoder.cli", ("--prompt-ids", "--json", "--trace-out"))
    if missing:
        raise UsageError(f"this moestream's `generate` lacks {', '.join(missing)}, which this bench needs")
    rng = random.Random(args.seed)
    dev = block_device(args.model)
    return Plan(model=str(layout.path),  # the first part of a split model: what llama.cpp must be given
                prompt=[rng.randrange(layout.hparams.n_vocab) for _ in range(args.prompt_tokens)],
                tokens=args.tokens, threads=args.threads, prefetch=args.prefetch,
                temperature=args.temperature if args.sampling == "sample" else 0.0, seed=args.seed,
                block_stat=dev[1] if dev else None, workdir=workdir, timeout_s=args.timeout,
                decoder_args=list(args.decoder_arg), extra_bufts=args.llamacpp_extra_bufts,
                daemon_memory_flag=not _help_lacks("moestream.iod.main", ("--memory",)),
                disk_counter=args.disk_counter, direct=args.direct, capped=not args.no_cap,
                read_ahead=None if args.llamacpp_readahead < 0 else args.llamacpp_readahead)


def quiet_run(args: argparse.Namespace, run) -> dict[str, Any]:
    """`run()` once the machine is quiet enough (--quiet-load), its start load recorded."""
    load = wait_quiet(args.quiet_load, args.quiet_wait)
    return {**run(), "load_1m": load}


class Cold:
    """Drops the page cache before a run (cold), saying once if it cannot."""

    def __init__(self, cold: bool, model: str | list[str], notes: list[str]):
        self.files = [model] if isinstance(model, str) else list(model)  # every part of a split model
        self.cold, self.notes, self._warned = cold, notes, False

    def __call__(self) -> None:
        if not self.cold:
            return
        why = drop_caches()
        if why is None:
            return
        for path in self.files:
            evict_file(path)
        if not self._warned:
            self._warned = True
            self.notes.append(f"warm: could not drop caches ({why}); only the model file's pages are evicted "
                              "before each run (POSIX_FADV_DONTNEED), libraries stay cached")
            print(f"moestream bench capped: {self.notes[-1]}", file=sys.stderr)


# -- the phases ------------------------------------------------------------------------------
def warm_up(plan: Plan, layout: Any, parent: CgroupParent, args: argparse.Namespace) -> dict[str, Any]:
    """Uncapped run (own cgroup, no limit): the processes' memory, and the sampling decision."""
    r = run_moestream(plan, layout, parent, None, "warmup")
    if "error" in r:
        raise RuntimeError(f"warm-up run failed: {r['error']}")
    out = {"decoder_bytes": r["need_decoder"], "daemon_bytes": r["need_daemon"], "spread": r["spread"],
           "decoder_peak_bytes": r["peak_decoder"], "daemon_peak_bytes": r["peak_daemon"],
           "trace": r["trace_path"],
           "decode_tok_s": r["decode_tok_s"], "sampling": "greedy"}
    if args.sampling == "sample" or (args.sampling == "auto" and r["spread"]["narrow"]):
        plan.temperature = args.temperature
        out["sampling"] = f"temperature {args.temperature}, seed {args.seed}"
    return out


def uncapped_phase(plan: Plan, layout: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Warm, no cap: moestream --resident beside llama.cpp; one untimed run each first."""
    sides: dict[str, list] = {"moestream": [], "llamacpp": []}
    for i in range(args.repeat + 1):
        ms = run_moestream(plan, layout, None, None, f"res{i}", resident=True)
        ll = run_llamacpp(plan, None, None, f"llu{i}") if args.llamacpp else None
        if i:  # the first pass warms the page cache (and compiled kernels' caches)
            for side, r in (("moestream", ms), ("llamacpp", ll)):
                if r is not None:
                    sides[side].append({k: r[k] for k in UNCAPPED_FIGURES if k in r})
    out = {side: medians(r) for side, r in sides.items() if r}
    if "llamacpp" in out:
        out["ratio"] = ratio(out["moestream"].get("decode_tok_s"), out["llamacpp"].get("decode_tok_s"))
    return out


def llamacpp_at(plan: Plan, parent: CgroupParent, cap: int | None, tag: str, kb: int | None,
                notes: list[str]) -> dict[str, Any]:
    """One llama.cpp run with the block device's readahead at `kb` KB (None: as it is)."""
    with ReadAhead(read_ahead_file(plan.block_stat), kb) as ra:
        if ra.why and ra.why not in notes:
            notes.append(ra.why)
        r = run_llamacpp(plan, parent, cap if plan.capped else None, tag)
        return {**r, "read_ahead_kb": ra.current()}


def capped_runs(plan: Plan, layout: Any, parent: CgroupParent, splits: dict[str, Split], caps: list[tuple[str, int]],
                args: argparse.Namespace, cold: Cold, notes: list[str]) -> dict[str, dict[str, list]]:
    """Interleaved: for each repeat, for each cap, moestream then llama.cpp (drift spreads over both)."""
    runs: dict[str, dict[str, list]] = {text: {side: [] for side in SIDES} for text, _ in caps}
    for i in range(args.repeat):
        for text, cap in caps:
            cold()
            runs[text]["moestream"].append(quiet_run(args, lambda: run_moestream(plan, layout, parent, splits[text],
                                                                                  f"ms{i}")))
            if args.llamacpp:
                cold()
                runs[text]["llamacpp"].append(quiet_run(args, lambda: llamacpp_at(plan, parent, cap, f"ll{i}",
                                                                                  plan.read_ahead, notes)))
            if args.llamacpp and args.llamacpp_default_readahead and i == 0:  # its figure, once: it is slow
                cold()
                runs[text]["llamacpp_default_ra"].append(quiet_run(args, lambda: llamacpp_at(
                    plan, parent, cap, f"lld{i}", None, notes)))
    return runs


def _setup(plan: Plan, layout: Any, parent: CgroupParent, args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """The result's description of the model and the method."""
    ex, hp = layout.experts, layout.hparams
    return {"model": plan.model, "file_bytes": layout.file_size, "dense_bytes": layout.dense_bytes,
            "expert_bytes": ex.total_bytes, "n_layer": hp.n_layer, "n_expert": hp.n_expert, "top_k": hp.n_expert_used,
            "tokens": plan.tokens, "prompt_tokens": len(plan.prompt), "threads": plan.threads, "repeat": args.repeat,
            "cold": args.cold, "prefetch": plan.prefetch, "direct": plan.direct, "capped": plan.capped,
            "read_ahead_default_kb": ReadAhead(read_ahead_file(plan.block_stat), None).old,
            "read_ahead_llamacpp_kb": plan.read_ahead,
            "cgroup": f"v{parent.version} under {parent.path}",
            "disk": block_device(plan.model)[0] if plan.block_stat else None,
            "daemon_sizing": "--memory" if plan.daemon_memory_flag else "--arena-bytes", "notes": notes}


def measure(args: argparse.Namespace, layout: Any, caps: list[tuple[str, int]], headroom: int,
            workdir: Path) -> dict[str, Any]:
    """warm-up -> the caps' splits -> disk bandwidth -> (uncapped) -> the capped runs -> summary."""
    parent = find_cgroup_parent(args.cgroup_parent)
    MemoryCgroup(parent, None, "probe").remove()  # can we create one at all? (clear error before any run)
    plan = make_plan(args, layout, workdir)
    plan.force_routing, workload = prepare_trace(args.routing, layout, len(plan.prompt) + plan.tokens, args.seed, workdir)
    notes: list[str] = []
    cold = Cold(args.cold, [str(f.path) for f in layout.files], notes)
    out = _setup(plan, layout, parent, args, notes)
    out["routing"] = {"kind": args.routing.label(), **workload}
    out["warmup"] = warm = warm_up(plan, layout, parent, args)
    out["sampling"] = warm["sampling"]
    ex = layout.experts
    min_slots = max(MIN_ARENA_SLOTS, layout.hparams.n_expert_used)
    splits = {text: split_budget(cap, warm["decoder_bytes"], warm["daemon_bytes"], headroom,
                                 ex.slot_bytes(plan.direct), min_slots, ex.n_blobs, text)
              for text, cap in caps}
    if caps:  # (the disk matters to the capped runs only)
        cold()
        out["bandwidth"] = probe_bandwidth(layout, args.seed, 256 << 20, DAEMON_DEPTH, plan.direct)
        cold()
        shape = shape_of(layout)
        out["bandwidth_demand"] = probe_bandwidth(layout, args.seed + 1, 64 << 20, shape.demand_depth, plan.direct)
        if shape.demand_depth > shape.parts:  # a layer that misses one expert reads at its depth
            cold()
            out["bandwidth_one"] = probe_bandwidth(layout, args.seed + 2, 32 << 20, shape.parts, plan.direct)
    if args.uncapped:
        out["uncapped"] = uncapped_phase(plan, layout, args)
    elif caps and not args.compute_tok_s:
        out["compute_probe"] = probe_compute(layout)  # (before the runs: the runs start cold anyway)
    runs = capped_runs(plan, layout, parent, splits, caps, args, cold, notes)
    out["caps"] = [summarize(text, splits[text], runs[text], out) for text, _ in caps]
    for cap in out["caps"]:
        cap["forecast"] = cap_forecast(layout, splits[cap["cap"]], warm, out, cap, args.compute_tok_s,
                                       plan.prefetch > 0)
    return out


def cap_forecast(layout: Any, split: Split, warm: dict[str, Any], out: dict[str, Any], cap: dict[str, Any],
                 given_tok_s: float | None = None, prefetch: bool = True) -> dict[str, Any]:
    """`moestream plan`'s arithmetic for this cap's arena, from this run's own inputs: the disk
    bandwidth measured above, the warm-up's routing replayed through the daemon's policy on the
    arena's slots, and the resident compute rate (--uncapped, --compute-tok-s), else the kernels'
    rate on this file (`plan --probe`'s); and again at the disk speed of the cap's own runs
    (`cap`: its summary)."""
    s = shape_of(layout)
    resident = given_tok_s or out.get("uncapped", {}).get("moestream", {}).get("decode_tok_s")
    probe = out.get("compute_probe")
    if resident:
        compute_s, basis = 1.0 / resident, f"compute: a resident rate of {resident:.2f} tok/s"
    elif probe:
        compute_s = probe["compute_s"]
        basis = (f"compute: the kernels on this file at {probe['bytes_per_s'] / 1e9:.1f} GB/s + "
                 f"{probe['glue_s'] * 1e3:.0f} ms of the rest of a step, assumed (--uncapped measures a whole token)")
    else:
        compute_s = s.active_bytes / DEFAULT_COMPUTE_RATE
        basis = f"compute: assumed {DEFAULT_COMPUTE_RATE:.0e} B/s of weights"
    # the arena the daemon made (it keeps a margin beside its own memory: 151 slots where the split
    # planned 187 on a 607 MiB cap), else the split's
    slots = round((cap.get("moestream") or {}).get("arena_slots") or split.slots)
    hit = arena_policy(load_trace(warm["trace"]), slots, s.expert_bytes).get("hit_rate", 0.0)
    # reads as deep as one layer's demand without prefetch (one expert's where a layer misses one);
    # with it, the daemon keeps its queue full
    bw = out["bandwidth"] if prefetch else out["bandwidth_demand"]
    one = None if prefetch else (out.get("bandwidth_one") or {}).get("bytes_per_s")
    f = forecast_slots(s, split.cap, slots, hit, bw["bytes_per_s"], compute_s, one_bandwidth=one)
    # The same arithmetic at the disk speed the runs themselves got (the daemon's bytes over its
    # seconds with a read in flight): a virtual disk's speed moved 0.67-1.93 GB/s between a probe
    # and the runs a minute later, which this separates from the model's own error.
    run_bps = (cap.get("moestream") or {}).get("daemon_read_bytes_per_s")
    at_run = forecast_slots(s, split.cap, slots, hit, run_bps, compute_s,
                            one_bandwidth=one * run_bps / bw["bytes_per_s"] if one else None) if run_bps else None
    # a run that prefetches overlaps its reads with compute; forced routing runs without prefetch
    pick = (lambda g: g.tok_s_prefetched if prefetch else g.tok_s)  # noqa: E731
    return {"tok_s": pick(f), "hit_rate": f.hit_rate, "io_s": f.io_s, "compute_s": f.compute_s,
            "tok_s_at_run_disk": pick(at_run) if at_run else None, "run_disk_bytes_per_s": run_bps,
            "slots": slots,
            "basis": f"the arena's policy ({slots} slots) hits {f.hit_rate:.2f} on the warm-up's routing, reads at "
                     f"{bw['bytes_per_s'] / 1e9:.2f} GB/s ({bw['depth']} in flight"
                     + (f", {one / 1e9:.2f} with one expert's" if one else "") + "; "
                     f"{'prefetching: max(compute, I/O)' if prefetch else 'compute + I/O'}), "
                     f"{basis}; {MISS_CPU_S * 1e3:g} ms of CPU a missed expert (plan's --miss-cpu), "
                     + ("beside the compute" if prefetch else "overlapping its layer's reads")}


def main(argv: list[str] | None = None) -> int:
    from ...demo import sigterm_as_exit

    args = build_parser().parse_args(argv)
    try:
        layout, caps, headroom = check_args(args)
        with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="msbench-") as tmp:  # cgroups go on SIGTERM too
            result = measure(args, layout, caps, headroom, Path(tmp))
    except KeyboardInterrupt:
        print("\nmoestream bench capped: interrupted", file=sys.stderr)
        return 130
    except (UsageError, CgroupError) as e:
        print(f"moestream bench capped: {e}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as e:
        print(f"moestream bench capped: a run took longer than {e.timeout:.0f} s (--timeout): {e.cmd[0]} ...",
              file=sys.stderr)
        return 1
    except (OSError, RuntimeError, ValueError) as e:
        print(f"moestream bench capped: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str) if args.json else format_report(result))
    return 1 if any_failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
