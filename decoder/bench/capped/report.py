"""The figures of `moestream bench capped`, summed up and shown: medians per cap and side, the
ratios and bounds (disk / ideal LRU, the disk bound, tok/s / bound), and the tables people read
(--json prints the same result as one object).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .plan import Split, fmt_bytes
from .routing_replay import is_narrow

SIDES = ("moestream", "llamacpp", "llamacpp_default_ra")  # the last: llama.cpp at the device's own readahead
COLUMN = {"moestream": "moestream", "llamacpp": "llama.cpp", "llamacpp_default_ra": "llama.cpp RA"}


# -- summing up ------------------------------------------------------------------------------
def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of every numeric field over the runs that did not fail; `runs` and `errors` kept."""
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"runs": runs, "errors": [r["error"] for r in runs if "error" in r]}
    for key in (ok[0] if ok else {}):
        vals = [r.get(key) for r in ok]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = statistics.median(vals)
        elif all(isinstance(v, str) for v in vals) and len(set(vals)) == 1:
            out[key] = vals[0]  # a label every run agrees on (e.g. where disk bytes were counted)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(text: str, split: Split, runs: dict[str, list], out: dict[str, Any]) -> dict[str, Any]:
    """Medians per side, and the ratios of one cap."""
    sides = {side: medians([_flat(r) for r in runs[side]]) if runs.get(side) else None for side in SIDES}
    ms, ll = sides["moestream"], sides["llamacpp"]
    bw = out["bandwidth"]["bytes_per_s"]
    lru = ms.get("lru_missed_per_token")
    cap = {"cap": text, "cap_bytes": split.cap, "split": asdict(split), **sides,
           "disk_bound_tok_s": bw / lru if lru else None}  # None too when the ideal LRU misses nothing
    uncapped = out.get("uncapped", {})
    for side, r in sides.items():
        if r is not None:
            r["disk_over_lru"] = ratio(r.get("disk_per_token"), lru)
            r["disk_over_belady"] = ratio(r.get("disk_per_token"), ms.get("belady_missed_per_token"))
            # the bound: min(this side's uncapped compute rate, if measured, the disk bound)
            compute = uncapped.get("llamacpp" if side.startswith("llamacpp") else side, {}).get("decode_tok_s")
            limits = [v for v in (compute, cap["disk_bound_tok_s"]) if v]
            r["bound_tok_s"] = min(limits) if limits else None
            r["over_bound"] = ratio(r.get("decode_tok_s"), r["bound_tok_s"])
    if ll is not None:
        cap["ratio"] = ratio(ms.get("decode_tok_s"), ll.get("decode_tok_s"))
    return cap


def _flat(r: dict[str, Any]) -> dict[str, Any]:
    """A run's nested figures (spread, LRU) as top-level numbers, for the medians."""
    f = {k: v for k, v in r.items() if k not in ("spread", "lru")}
    decode = (r.get("own_reads") or {}).get("decode")
    if decode and r.get("new_tokens", 0) > 1:  # each process's own disk reads in the decode steps, a token
        f.update({f"{name}_reads_per_token": n / (r["new_tokens"] - 1) for name, n in decode.items()})
    if "spread" in r:
        f.update(spread_mean=r["spread"]["mean_distinct"], spread_share=r["spread"]["share"])
    if "lru" in r:
        f.update(lru_hit_rate=r["lru"].get("hit_rate"), lru_capacity=r["lru"]["capacity"],
                 belady_hit_rate=r["lru"].get("belady_hit_rate"),
                 belady_missed_per_token=r["lru"].get("belady_missed_bytes_per_token"))
        if "error" in r["lru"]:
            f["lru_error"] = r["lru"]["error"]
    return f


def any_failed(result: dict[str, Any]) -> bool:
    return any(c.get(side) and c[side]["errors"] for c in result["caps"] for side in SIDES)


# -- the tables ------------------------------------------------------------------------------
def _num(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else ("inf" if v == math.inf else format(v, spec))


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}"


def format_report(r: dict[str, Any]) -> str:
    lines = _header(r)
    if "uncapped" in r:
        lines += ["", *_uncapped_lines(r["uncapped"])]
    for cap in r["caps"]:
        lines += ["", *cap_table(cap, r)]
    return "\n".join(lines)


def _header(r: dict[str, Any]) -> list[str]:
    reads = "O_DIRECT" if r["direct"] else "through the page cache (--no-direct)"
    lines = [(f"moestream bench capped: {Path(r['model']).name} ({fmt_bytes(r['file_bytes'])}; {r['n_layer']} x "
             f"{r['n_expert']} experts, top {r['top_k']}, experts {fmt_bytes(r['expert_bytes'])}, dense "
             f"{fmt_bytes(r['dense_bytes'])}), prompt {r['prompt_tokens']} ids, {r['tokens']} tokens, "
             f"{r['threads']} threads, {'cold' if r['cold'] else 'warm'}, {r['repeat']} run(s) per cap and side "
             f"(medians)"),
             f"cgroups: {r['cgroup']}; daemon sized with {r['daemon_sizing']}, reads {reads}"]
    w = r["warmup"]
    sp = w["spread"]
    sampled = r["sampling"] != "greedy"
    lines.append(f"sampling: {r['sampling']}" + (
        f" (greedy routing in the warm-up was narrow: {sp['mean_distinct']:.1f} of {sp['n_expert']} experts per "
        f"layer, {sp['share']:.0%}); the two sides sample different tokens" if sampled and sp["narrow"] else
        "; the two sides sample different tokens" if sampled else ""))
    rt = r.get("routing", {})
    if rt:
        lines.append(f"routing: {rt['kind']}" + "".join(f"; {rt[k]}" for k in ("curve", "trace", "wraps") if k in rt)
                     + (f"; prefetch {r['prefetch']}" if rt["kind"].startswith(("trace", "curve")) else ""))
    if r.get("read_ahead_llamacpp_kb") is not None:
        lines.append(f"llama.cpp runs with the block device's readahead at {r['read_ahead_llamacpp_kb']} KB (device "
                     f"default {r.get('read_ahead_default_kb')} KB, restored after each run)")
    if not r.get("capped", True):
        lines.append("no cap (--no-cap): --memory sizes moestream's arena only; llama.cpp's page cache takes what the "
                     "machine has")
    bw = r.get("bandwidth")
    if bw:
        lines.append(f"disk: {r['disk'] or 'no block device (per-process /proc/PID/io counters)'}; bandwidth "
                     f"{bw['bytes_per_s'] / 1e9:.2f} GB/s (cold reads of {fmt_bytes(bw['bytes'])} of random experts"
                     f"{_rounds(bw)} "
                     f"through the daemon's reader: {bw.get('reader', bw['depth'])}"
                     f"{', O_DIRECT' if bw.get('direct') else ''})")
    lines.append(f"memory measured in the uncapped warm-up: decoder {fmt_bytes(w['decoder_bytes'])}, daemon "
                 f"{fmt_bytes(w['daemon_bytes'])} (peak RssAnon + the file pages used once the daemon served, else "
                 f"the last RssFile; arena excluded; peak RssAnon + RssFile "
                 f"{fmt_bytes(w.get('decoder_peak_bytes'))} and {fmt_bytes(w.get('daemon_peak_bytes'))})")
    return lines + [f"note: {n}" for n in r["notes"]]


def _rounds(bw: dict[str, Any]) -> str:
    """", the median of 3 rounds (1.21-1.93 GB/s)" when the probe read in rounds."""
    rates = bw.get("rounds") or []
    if len(rates) < 2:
        return ""
    return f", the median of {len(rates)} rounds ({rates[0] / 1e9:.2f}-{rates[-1] / 1e9:.2f} GB/s)"


def _uncapped_lines(u: dict[str, Any]) -> list[str]:
    ms, ll = u["moestream"], u.get("llamacpp")
    row = f"uncapped, warm (moestream --resident): moestream {_num(ms.get('decode_tok_s'), '.2f')} tok/s"
    if ll is not None:
        row += f", llama.cpp {_num(ll.get('decode_tok_s'), '.2f')} tok/s, ratio {_num(u.get('ratio'), '.2f')}"
    lines = [row]
    for name, side in (("moestream", ms), ("llama.cpp", ll)):
        runs = [run.get("decode_tok_s") for run in (side or {}).get("runs", [])]
        if runs:
            lines.append(f"  {name} runs: " + ", ".join(_num(v, ".2f") for v in runs)
                         + f"; prefill {_num(side.get('prefill_s'), '.3f')} s")
    return lines


def cap_table(cap: dict[str, Any], r: dict[str, Any]) -> list[str]:
    ms, ll, s = cap["moestream"], cap["llamacpp"], cap["split"]
    extra = cap.get("llamacpp_default_ra")
    n_experts = r["n_layer"] * r["n_expert"]
    lines = [f"cap {cap['cap']} = {fmt_bytes(cap['cap_bytes'])}: " + Split(**s).describe(n_experts)]
    slots = ms.get("arena_slots")
    if slots is not None and slots != s["slots"]:
        lines.append(f"  (the daemon made {slots:.0f} slots)")
    sides = [("moestream", ms)] + ([("llama.cpp", ll)] if ll is not None else []) + (
        [("llama.cpp RA", extra)] if extra is not None else [])
    lines.append(f"  {'':<26}" + "".join(f"{name:>13}" for name, _ in sides) + ("        ratio" if ll else ""))

    def row(label: str, key: str, f: Any, show_ratio: bool = False) -> None:
        cells = "".join(f"{f(side.get(key)):>13}" for _, side in sides)
        last = f"{_num(ratio(ms.get(key), ll.get(key))):>13}" if show_ratio and ll else ""
        lines.append(f"  {label:<26}{cells}{last}")

    row("decode tok/s", "decode_tok_s", _num, True)
    for label, key in (("  runs", "decode_tok_s"), ("  1-min load at start", "load_1m")):
        lines.append(f"  {label:<26}" + "".join(" " + f"{_runs(side, key):>12}" for _, side in sides))
    row("prefill s", "prefill_s", _num)
    row("disk MB/token (decode)", "disk_per_token", _mb)
    row("  block device MB/token", "block_per_token", _mb)
    row("  own processes MB/token", "proc_disk_per_token", _mb)
    row("disk / ideal LRU", "disk_over_lru", _num)
    row("disk / Belady", "disk_over_belady", _num)
    if ll is not None:
        row("readahead KB", "read_ahead_kb", lambda v: _num(v, ".0f"))
    row("bound tok/s", "bound_tok_s", _num)
    row("tok/s / bound", "over_bound", _num)
    row("peak memory (cgroup) MiB", "peak_memory", lambda v: _num(v / 2**20 if v is not None else None, ".0f"))
    row("OOM kills", "oom_kills", lambda v: _num(v, ".0f"))
    if "forecast" in cap:
        fc = cap["forecast"]
        lines.append(f"  forecast (moestream plan) tok/s: {_num(fc.get('tok_s'))}, measured / forecast "
                     f"{_num(ratio(ms.get('decode_tok_s'), fc.get('tok_s')))}; {fc.get('basis', '')}")
        at_run = fc.get("tok_s_at_run_disk")
        if at_run:
            lines.append(f"  the same at the runs' own disk speed ({fc['run_disk_bytes_per_s'] / 1e9:.2f} GB/s: the "
                         f"daemon's bytes over its seconds with a read in flight): {_num(at_run)} tok/s, "
                         f"measured / that {_num(ratio(ms.get('decode_tok_s'), at_run))}")
    return lines + _lru_notes(cap, ms, r) + _moestream_notes(ms, r) + _side_notes(ms, ll, extra)


def _runs(side: dict, key: str) -> str:
    """Every run's figure, for the spread behind a median."""
    vals = [r.get(key) for r in side.get("runs", []) if "error" not in r]
    return ",".join(_num(v, ".1f" if key == "load_1m" else ".2f") for v in vals) or "-"


def _lru_notes(cap: dict[str, Any], ms: dict, r: dict[str, Any]) -> list[str]:
    lru = ms.get("lru_missed_per_token")
    if ms.get("lru_error"):
        return [f"  ideal LRU: {ms['lru_error']}"]
    if lru is None:
        return []
    return [f"  ideal LRU ({ms.get('lru_capacity', 0):.0f} slots, moestream's routing): {_mb(lru)} MB/token "
            f"missed, hit rate {_num(ms.get('lru_hit_rate'), '.1%')}; Belady {_mb(ms.get('belady_missed_per_token'))} "
            f"MB/token, hit rate {_num(ms.get('belady_hit_rate'), '.1%')}; disk bound "
            f"{_num(cap['disk_bound_tok_s'])} tok/s = {r['bandwidth']['bytes_per_s'] / 1e9:.2f} GB/s / that; "
            + ("bound = min(each side's uncapped tok/s, disk bound)" if "uncapped" in r else
               "bound = the disk bound (--uncapped adds each side's compute rate to it)")]


def _moestream_notes(ms: dict, r: dict[str, Any]) -> list[str]:
    out = []
    if "spread_mean" in ms:
        narrow = is_narrow(ms["spread_share"], r["tokens"])
        out.append(f"  routing spread (moestream, decode steps): {ms['spread_mean']:.1f} of {r['n_expert']} experts "
                   f"per layer ({ms['spread_share']:.0%})" + (": narrow, this model routes most tokens to few "
                                                                 "experts" if narrow else ""))
    if "decode_s" in ms:
        out.append(f"  moestream counters: stall {_num(ms.get('stall_s'))} s, delivered from the arena "
                   f"{fmt_bytes(ms.get('fetched_bytes'))}"
                   f", compute {_num(ms.get('compute_s'))} s, daemon read {fmt_bytes(ms.get('daemon_read_bytes'))}, "
                   f"daemon hit rate {_num(ms.get('daemon_hit_rate'), '.1%')}{_prefetch_note(ms)}{_cpu_note(ms)}")
    if ms.get("decoder_reads_per_token") is not None:
        # the decoder's reads are file pages: first touches (readahead included), or pages the cap made it re-read
        out.append(f"  own reads in the decode: decoder {_mb(ms['decoder_reads_per_token'])} MB/token (its file "
                   f"pages: first touches, or re-read under the cap), daemon {_mb(ms.get('daemon_reads_per_token'))}")
    return out


def _cpu_note(ms: dict) -> str:
    """"; daemon CPU in the decode 1.02 s (0.81 ms an expert read)" where measured."""
    cpu, per = ms.get("daemon_cpu_s"), ms.get("daemon_cpu_ms_per_read")
    if cpu is None:
        return ""
    return f"; daemon CPU in the decode {cpu:.2f} s" + (f" ({per:.2f} ms an expert read)" if per is not None else "")


def _prefetch_note(ms: dict) -> str:
    """"; wanted experts not in the arena 64.2 %, prefetches wide in 250 of 256 hints" where known."""
    share, hints = ms.get("miss_share"), ms.get("prefetch_hints")
    out = f"; wanted experts not in the arena {share:.1%}" if share is not None else ""
    return out + (f", prefetches wide in {ms.get('prefetch_wide', 0):.0f} of {hints:.0f} hints" if hints else "")


def _side_notes(ms: dict, ll: dict | None, extra: dict | None = None) -> list[str]:
    out = []
    for name, side in (("moestream", ms), ("llama.cpp", ll), ("llama.cpp RA", extra)):
        if side is not None and "decode_s" in side:
            out.append(f"  {name} disk: counted on {side.get('disk_source') or 'varying counters'}; read "
                       f"{fmt_bytes(side.get('load_disk_bytes'))} loading, {fmt_bytes(side.get('prefill_disk_bytes'))} "
                       f"in the prefill (not in the rows above)")
    for name, side in (("moestream", ms), ("llama.cpp", ll), ("llama.cpp RA", extra)):
        for err in (side or {}).get("errors", []):
            out.append(f"  {name} run failed: {err}")
    return out
