"""The daemon's counters in Prometheus text format on an optional loopback port (`--metrics-port`).

Counters and gauges are read from the same state `status` reports, at scrape time, on the
event loop (so a scrape never sees a half-updated count); the fetch latency histogram is
observed as each `ready` goes out. The HTTP side is a minimal GET responder on the daemon's own
event loop: a scrape is one short request, and the daemon takes no web framework for it.
Names follow Prometheus conventions (`moestream_iod_` prefix, `_total` counters, `_bytes`,
`_seconds`); README lists them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("moestream.iod")
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HOST = "127.0.0.1"  # loopback only: the counters name clients and models


class Metrics:
    """One daemon's registry: the latency histogram plus a collector over its status."""

    def __init__(self, server: Server):
        self.registry = CollectorRegistry(auto_describe=False)
        self.fetch_latency = Histogram(
            "moestream_iod_fetch_latency_seconds", "Time from a fetch request to its ready, by how it was served "
            "(hit: in the arena; miss: read from the file)", ["result"], buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self.registry.register(_StatusCollector(server))

    def observe_fetch(self, seconds: float, miss: bool) -> None:
        self.fetch_latency.labels("miss" if miss else "hit").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatusCollector:
    def __init__(self, server: Server):
        self.server = server

    def collect(self):  # noqa: ANN201 (prometheus_client's collector protocol)
        from .status import build_status

        s = build_status(self.server, hottest=0)
        requests = CounterMetricFamily("moestream_iod_requests", "Expert requests, by how they were served "
                                       "(joined: attached to a read already under way)", labels=["result"])
        for label, key in (("hit", "hits"), ("joined", "joined"), ("miss", "misses")):
            requests.add_metric([label], s[key])
        yield requests
        errors = CounterMetricFamily("moestream_iod_errors", "Error replies, by code", labels=["code"])
        for code, n in sorted(s["errors_by_code"].items()):
            errors.add_metric([code], n)
        yield errors
        counters = {
            "readies": ("moestream_iod_readies", "Experts delivered (ready replies)"),
            "releases": ("moestream_iod_releases", "Leases given back"),
            "reads": ("moestream_iod_reads", "Expert reads from the file completed"),
            "read_errors": ("moestream_iod_read_errors", "Expert reads that failed"),
            "bytes_read": ("moestream_iod_read_bytes", "Expert bytes read from the file"),
            "bytes_served": ("moestream_iod_served_bytes", "Expert bytes delivered to clients"),
            "disk_read_bytes": ("moestream_iod_disk_read_bytes", "Bytes the kernel read from storage for the daemon"),
            "replies_dropped": ("moestream_iod_replies_dropped", "Replies dropped for clients that do not read"),
            "clients_seen": ("moestream_iod_clients_seen", "Clients that said hello"),
            "clients_expired": ("moestream_iod_clients_expired", "Clients dropped after their lease timeout"),
        }
        for key, (name, doc) in counters.items():
            yield CounterMetricFamily(name, doc, value=s[key])
        f = s["fairness"]
        yield CounterMetricFamily("moestream_iod_over_quota", "Requests that waited over their client's lease quota",
                                  value=f["over_quota_total"])
        yield CounterMetricFamily("moestream_iod_deadline", "Requests answered `deadline`", value=f["deadline_total"])
        yield from _gauges(s)


def _gauges(s: dict):
    a, q = s["arena"], s["queues"]
    gauges = {
        "moestream_iod_arena_slots": ("Arena slots (one expert each)", a["n_slots"]),
        "moestream_iod_arena_bytes": ("Arena size", a["arena_bytes"]),
        "moestream_iod_arena_resident_slots": ("Arena slots holding an expert", a["resident"]),
        "moestream_iod_arena_leased_slots": ("Arena slots leased by clients", a["leased_slots"]),
        "moestream_iod_leases": ("Leases held by clients", a["leases"]),
        "moestream_iod_clients": ("Clients connected", len(s["clients"])),
        "moestream_iod_reads_in_flight": ("Expert loads reading now", q["reading"]),
        "moestream_iod_read_throughput_bytes_per_second": ("Read rate over the last 10 s", s["read_mb_s"] * 1e6),
        "moestream_iod_uptime_seconds": ("Seconds since the daemon started", s["uptime_s"]),
    }
    for name, (doc, value) in gauges.items():
        yield GaugeMetricFamily(name, doc, value=value)
    queued = GaugeMetricFamily("moestream_iod_queued_loads", "Expert loads waiting for a read place",
                               labels=["priority"])
    queued.add_metric(["now"], q["queued_now"])
    queued.add_metric(["ahead"], q["queued_ahead"])
    yield queued


async def serve_metrics(metrics: Metrics, port: int) -> asyncio.AbstractServer:
    """Answer `GET /metrics` on 127.0.0.1:`port` (anything else: 404)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing in them changes the answer
            parts = request.split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, metrics.render()
            else:
                status, ctype, body = "404 Not Found", "text/plain; charset=utf-8", b"try GET /metrics\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass  # a slow or vanished scraper costs the daemon nothing more
        except Exception:  # noqa: BLE001 — a failed scrape must not end the daemon
            log.exception("metrics request failed")
        finally:
            writer.close()

    return await asyncio.start_server(handle, HOST, port)
