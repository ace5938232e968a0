"""`moestream bench serve`: a real `moestream serve` process at concurrency 1, 2, 4, ...

For each expert source (resident, and streamed from a moestream-iod started here) and each
concurrency c, the same greedy requests go to the server, c at a time, over HTTP with SSE.
Printed per row: total decode tok/s and its ratio to c = 1 (the sequential peer, same run),
time to first token p50/p99 (client side), and expert bytes per generated token from the
server's /metrics: `used` = the distinct experts of each step (what batching shares), `fetched` =
what the streamed source fetched from the daemon. It also checks that every concurrency
returned the same tokens as the sequential run (greedy is batch-invariant here).

Then a two-turn chat: turn 2's prompt tokens, how many the server's prefix cache gave (turn 1's
prompt and reply) and how many it prefilled (its /metrics counter), and each turn's latency.

Streamed, it then measures a warm start: the daemon's hit rate on a fresh server's first request
(its prompt and first token) after a daemon restart, cold and after `moestream warm --top N` (N = the arena's slots) from the
request history the daemon kept on disk while the rounds ran.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "src" / "moestream" / "data" / "tiny-qwen3moe-q8_0.gguf"
PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def ", "    return self.",
           "# Copyright", "for line in ", "if __name__ == ", "def __init__(self, "]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="GGUF MoE (default: the shipped tiny model)")
    ap.add_argument("--source", choices=["resident", "streamed", "both"], default="both")
    ap.add_argument("--concurrency", default="1,2,4", help="comma-separated levels (default 1,2,4)")
    ap.add_argument("--requests", type=int, default=8, help="requests per level (default 8)")
    ap.add_argument("--max-tokens", type=int, default=48, dest="max_tokens", help="tokens per request (default 48)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure every level this many times, levels interleaved, and keep the median tok/s "
                         "(default 3): a busy machine then skews every level alike")
    ap.add_argument("--arena-bytes", dest="arena_bytes",
                    help="streamed: the daemon's arena size, e.g. 8M (default: the daemon's own default)")
    return ap


@dataclass
class Reply:
    text: str
    tokens: int
    ttft_s: float


def complete(url: str, prompt: str, max_tokens: int) -> Reply:
    """One streamed greedy completion; time to first token measured here, at the client."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"server answered {resp.status}: {resp.read()[:300]!r}")
    text, ttft, tokens = [], 0.0, 0
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for c in chunk["choices"]:
            if not ttft and c["text"]:
                ttft = time.perf_counter() - t0
            text.append(c["text"])
    conn.close()
    return Reply("".join(text), tokens, ttft)


def scrape(url: str) -> dict[str, float]:
    """Counter and gauge samples of the server's /metrics, by sample name."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def level(url: str, c: int, n: int, max_tokens: int) -> dict[str, Any]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    before = scrape(url)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(c) as pool:
        replies = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    after = scrape(url)
    tokens = sum(r.tokens for r in replies)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ttfts = sorted(r.ttft_s for r in replies)
    return {"c": c, "tok_s": tokens / wall, "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99),
            "used_per_tok": d["moestream_serve_expert_used_bytes_total"] / max(tokens, 1),
            "fetched_per_tok": d["moestream_serve_expert_fetched_bytes_total"] / max(tokens, 1),
            "seqs_per_step": d["moestream_serve_step_sequences_sum"] / max(d["moestream_serve_step_sequences_count"], 1),
            "texts": [r.text for r in replies], "tokens": tokens}


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[dict, float]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": max_tokens,
                                                              "temperature": 0}), {"content-type": "application/json"})
    r = json.loads(conn.getresponse().read())
    conn.close()
    if "error" in r:
        raise RuntimeError(f"chat: {r['error']['message']}")
    return r, time.perf_counter() - t0


def chat_turns(url: str, max_tokens: int) -> dict[str, Any]:
    """Two turns of one conversation: what turn 2 prefilled, and what the prefix cache gave."""
    turn1 = [{"role": "user", "content": "Write a Python function that parses a line of CSV."}]
    r1, s1 = chat(url, turn1, max_tokens)
    turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Now make it handle quotes."}]
    before = scrape(url)
    r2, s2 = chat(url, turn2, max_tokens)
    prefilled = scrape(url)["moestream_serve_prompt_tokens_total"] - before["moestream_serve_prompt_tokens_total"]
    u = r2["usage"]
    return {"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"],
            "prefilled": int(prefilled), "turn1_s": s1, "turn2_s": s2}


def median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s of one level (its TTFTs and bytes come with it)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))
    return sorted_values[i]


def run_source(name: str, args: argparse.Namespace, levels: list[int], tmp: Path) -> list[dict]:
    from ..serve.process import spawn_server

    daemon = None
    try:
        if name == "streamed":
            from ...tools.spawn import spawn_daemon
            from ...common.units import parse_size

            arena = parse_size(args.arena_bytes) if args.arena_bytes else None
            daemon = spawn_daemon(args.model, run_dir=tmp / "iod", arena_bytes=arena,
                                  extra_args=["--history-file", str(tmp / "hotness.json")])
            source = ["--iod", daemon.endpoint]
        else:
            source = ["--resident"]
        with spawn_server(args.model, source, tmp / f"serve-{name}.log") as server:
            complete(server.url, PROMPTS[0], 4)  # warm-up: JIT compilation, first expert reads
            runs = [[level(server.url, c, args.requests, args.max_tokens) for c in levels] for _ in range(args.rounds)]
            t = chat_turns(server.url, min(args.max_tokens, 32))
            print(f"\n{name}: chat turn 2: {t['prompt']} prompt tokens, {t['cached']} from the prefix cache (turn 1), "
                  f"{t['prefilled']} prefilled; turn 1 {t['turn1_s'] * 1e3:.0f} ms, turn 2 {t['turn2_s'] * 1e3:.0f} ms")
            return [median_run([r[i] for r in runs]) for i in range(len(levels))]
    finally:
        if daemon is not None:
            daemon.stop()


def first_request_hit_rates(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """The daemon's hit rate on a fresh server's first token after a restart: cold, and after
    `warm --top` from the history the rounds left in tmp/hotness.json."""
    from ...common.client import IodClient
    from ...tools.spawn import spawn_daemon
    from ...tools.status import get_status
    from ...common.units import parse_size
    from ...tools.warm import keys_from_history, warm
    from ..serve.process import spawn_server

    arena = parse_size(args.arena_bytes) if args.arena_bytes else None
    out = {}
    for mode in ("cold", "warm"):
        with spawn_daemon(args.model, run_dir=tmp / f"iod-{mode}", arena_bytes=arena,
                          extra_args=["--history-file", str(tmp / "hotness.json")]) as d:
            if mode == "warm":
                with IodClient(d.endpoint, name="bench-warm") as client:
                    warm(client, keys_from_history(d.status_endpoint, int(client.welcome["n_slots"]))[::-1])
            with spawn_server(args.model, ["--iod", d.endpoint], tmp / f"serve-{mode}.log") as server:
                before = get_status(d.status_endpoint, hottest=0)
                complete(server.url, PROMPTS[1], 1)  # the prompt and its first token
                after = get_status(d.status_endpoint, hottest=0)
        hits = sum(after[k] - before[k] for k in ("hits", "joined"))
        out[mode] = hits / max(1, after["requests"] - before["requests"])
    return out


def report(name: str, rows: list[dict]) -> None:
    base = rows[0]
    print(f"\n{name}: {rows[0]['tokens']} tokens per level (median of the rounds)")
    print(f"{'concurrency':>11} {'tok/s':>8} {'x seq':>6} {'seqs/step':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'used KiB/tok':>12} {'fetched KiB/tok':>15} {'same tokens':>11}")
    for r in rows:
        print(f"{r['c']:>11} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>5.2f}x {r['seqs_per_step']:>9.2f} "
              f"{r['ttft_p50'] * 1e3:>7.0f}ms {r['ttft_p99'] * 1e3:>7.0f}ms {r['used_per_tok'] / 1024:>12.1f} "
              f"{r['fetched_per_tok'] / 1024:>15.1f} {'yes' if r['texts'] == base['texts'] else 'NO':>11}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        if not levels or min(levels) < 1 or min(args.requests, args.max_tokens, args.rounds) < 1:
            raise ValueError
    except ValueError:
        print("moestream bench serve: --concurrency must be integers >= 1 (e.g. 1,2,4); --requests and "
              "--max-tokens, --rounds >= 1", file=sys.stderr)
        return 2
    if not Path(args.model).is_file():
        print(f"moestream bench serve: --model {args.model}: no such file", file=sys.stderr)
        return 1
    sources = ["resident", "streamed"] if args.source == "both" else [args.source]
    print(f"model {Path(args.model).name}: {args.requests} greedy requests x {args.max_tokens} tokens per level, "
          f"concurrency {levels}, {args.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="msbench-") as tmp:
        for name in sources:
            report(name, run_source(name, args, levels, Path(tmp)))
        if "streamed" in sources:
            rates = first_request_hit_rates(args, Path(tmp))
            print(f"\nwarm start: a fresh server's first token after a daemon restart found {rates['cold']:.0%} of its "
                  f"experts in the arena cold, {rates['warm']:.0%} after `moestream warm --top` (the daemon's history)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
