"""`moestream status`: show a running moestream-iod's status (a table for people, --json for scripts).

`get_status` is the client side of the daemon's status socket (a REQ socket, one request).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import zmq

from ..common import protocol as P
from ..common.client import IodError, IodRequestError, IodUnavailable
from ..common.endpoints import endpoint_problem, no_answer



def get_status(endpoint: str, timeout_s: float = 3.0, hottest: int = 10) -> dict:
    """Ask a daemon's status endpoint for its status (a plain dict), listing its `hottest` experts."""
    problem = endpoint_problem(endpoint)
    if problem is not None:  # ZeroMQ would retry silently until the timeout
        raise IodUnavailable(problem)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(P.Status(hottest).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise IodUnavailable(f"no status: {no_answer(endpoint, timeout_s)}")
        msg = P.decode_reply(sock.recv())
    except zmq.ZMQError as e:
        raise IodUnavailable(f"cannot reach {endpoint!r}: {e}") from None
    except P.ProtocolError as e:
        raise IodError(f"bad status reply from {endpoint}: {e}") from None
    finally:
        sock.close()
    if isinstance(msg, P.Error):
        raise IodRequestError(msg.code, msg.message)
    if not isinstance(msg, P.StatusReply):
        raise IodError(f"unexpected reply {msg.op!r} from {endpoint}")
    return msg.status


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0 (a bad one is argparse's one-line usage error)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream status", description="Show a running moestream-iod's status.")
    p.add_argument("--endpoint", default=P.DEFAULT_STATUS_ENDPOINT,
                   help=f"the daemon's status endpoint (default {P.DEFAULT_STATUS_ENDPOINT})")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--watch", type=positive_seconds, metavar="N", help="refresh every N seconds until Ctrl-C")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer (default 3)")
    return p


def _mib(n: float | None) -> str:
    """Bytes for people: KiB below 1 MiB, GiB above 1 GiB."""
    if n is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.1f} {unit}"
    return f"{n:,.0f} B"


def _cpu(s: dict) -> str:
    """", CPU 1.01 s serving (0.78 ms a read)": the daemon's own CPU time since it began serving, all
    threads (an older daemon's status has none)."""
    cpu = s.get("cpu_s")
    if cpu is None:
        return ""
    return f", CPU {cpu:.2f} s serving" + (f" ({1e3 * cpu / s['reads']:.2f} ms a read)" if s["reads"] else "")


def _fairness(f: dict[str, Any] | None) -> str:
    if not f:
        return "-"  # an older daemon
    quota = f"{f['client_lease_quota']} slots" if f["client_lease_quota"] is not None else "off"
    return (f"lease quota per client {quota} (share {f['client_lease_share']:g}), queue deadline "
            f"{f['queue_deadline_s']:g} s; parked now {f['parked']}, over quota {f['over_quota_total']:,}, "
            f"deadline errors {f['deadline_total']:,}")


ROUTINE = ("not_cached",)  # answers a client asked for (a `cached` prefetch of an absent expert), not faults


def _errors(s: dict[str, Any]) -> str:
    """Real errors; the routine `not_cached` answers to cached-only prefetches are counted apart."""
    by_code = dict(s.get("errors_by_code") or {})
    routine = {c: by_code.pop(c) for c in ROUTINE if c in by_code}
    n = s["errors"] - sum(routine.values())
    out = f"{n:,} " + (json.dumps(by_code) if by_code else "")
    if routine:
        out += f"; routine: {routine.get('not_cached', 0):,} not_cached (prefetches of experts the arena did not hold)"
    return out


def format_status(s: dict[str, Any]) -> str:
    a, q, lat = s["arena"], s["queues"], s["latency"]
    b = s["backend"]
    rows = [
        ("model", f"{s['model']} ({s['arch']}, {s['index']['n_layer']} layers x {s['index']['n_expert']} experts)"),
        ("pid / uptime", f"{s['pid']} / {s['uptime_s']:.0f} s" + _cpu(s)),
        ("backend", f"{b['name']} depth {b['queue_depth']}{' O_DIRECT' if b['direct'] else ''}"
                    f"{', READ_FIXED into the registered arena' if b.get('registered') else ''}"
                    + (f"  ({b['note']})" if b["note"] else "")),
        ("arena", f"{a['name']}: {a['n_slots']} slots x {_mib(a['slot_bytes'])} = {_mib(a['arena_bytes'])}; "
                  f"{a['resident']} resident, {a['loading']} loading, {a['leased_slots']} leased"
                  + (f"; evicts as {a['evicts_as'].upper()}" if "evicts_as" in a else "")),
        ("requests", f"{s['requests']:,}: {s['hits']:,} hits, {s['joined']:,} joined, {s['misses']:,} misses; "
                     f"{s.get('direct_hits', 0):,} read straight from the arena by decoders (hit rate "
                     f"{s['hit_rate']:.1%})"),
        ("bytes", f"served {_mib(s['bytes_served'])}, read {_mib(s['bytes_read'])} in {s['reads']:,} reads, "
                  f"disk {_mib(s['disk_read_bytes'])}; {s['read_mb_s']:.1f} MB/s (last 10 s)"),
        ("queues", f"now {q['queued_now']}, ahead {q['queued_ahead']}, reading {q['reading']}/{q['max_inflight']}; "
                   f"dropped {q['dropped']}, busy {q['refused_busy']}"),
        ("fairness", _fairness(s.get("fairness"))),
        ("in flight", f"expert loads peak {q['in_flight']['peak']}, mean {q['in_flight']['mean']:.1f} (prefetch <= "
                      f"{q['ahead_max_inflight']}); device reads peak {s['reader']['in_flight']['peak']}, "
                      f"mean {s['reader']['in_flight']['mean']:.1f}"),
        ("latency", f"all p50 {lat['all']['p50_ms']:.3f} ms p99 {lat['all']['p99_ms']:.3f} ms; "
                    f"miss p50 {lat['miss']['p50_ms']:.3f} ms p99 {lat['miss']['p99_ms']:.3f} ms"),
        ("errors", _errors(s)
                   + (f"; {s['replies_dropped']:,} replies dropped (client not reading)" if s.get("replies_dropped") else "")),
        ("hottest", ", ".join(f"({layer},{e})x{n}" for layer, e, n in s["hottest"][:8]) or "-"),
    ]
    lines = [f"{k:<14} {v}" for k, v in rows]
    lines.append(f"clients ({len(s['clients'])})")
    if s["clients"]:
        lines.append(f"  {'name':<20} {'pid':>7} {'leases':>6} {'requests':>9} {'hits':>8} {'misses':>7} {'served':>12} {'idle':>6}")
        for c in s["clients"]:
            lines.append(f"  {P.escape(str(c['name']))[:20]:<20} {c['pid']:>7} {c['leases']:>6} {c['requests']:>9,} "
                         f"{c['hits'] + c['joined']:>8,} {c['misses']:>7,} {_mib(c['bytes_served']):>12} {c['idle_s']:>5.1f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    while True:
        try:
            s = get_status(args.endpoint, args.timeout)
        except IodError as e:
            print(f"moestream status: {e}", file=sys.stderr)
            return 1
        print(json.dumps(s, indent=2, sort_keys=True) if args.json else format_status(s), flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        if args.json:
            continue
        if sys.stdout.isatty():
            print("\033[2J\033[H", end="")  # clear the screen between refreshes
        else:  # a file or a pipe gets the snapshots one after another, no screen codes
            print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
