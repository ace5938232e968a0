"""The server's Prometheus metrics, in a registry of its own (never the process-global one).

Names follow Prometheus conventions: a `moestream_serve_` prefix, base units in the name
(`_seconds`, `_bytes`), `_total` on counters (the client library appends it).

| metric | kind | meaning |
|---|---|---|
| moestream_serve_requests_total{outcome} | counter | finished requests: stop, length, cancelled, error |
| moestream_serve_prompt_tokens_total | counter | prompt tokens prefilled |
| moestream_serve_prefix_cached_tokens_total | counter | prompt tokens taken from the prefix cache instead |
| moestream_serve_generation_tokens_total | counter | tokens generated |
| moestream_serve_time_to_first_token_seconds | histogram | request accepted -> first token sampled |
| moestream_serve_time_per_output_token_seconds | histogram | between consecutive tokens of one request |
| moestream_serve_steps_total | counter | engine steps (one forward pass over the batch) |
| moestream_serve_step_sequences | histogram | sequences per step (the batch size) |
| moestream_serve_expert_used_bytes_total | counter | bytes of the distinct experts each step used |
| moestream_serve_expert_fetched_bytes_total | counter | expert bytes the source fetched (streamed; 0 resident) |
| moestream_serve_running_sequences / _waiting_sequences | gauge | batch now / queued |
| moestream_serve_request_expert_fetched_bytes | histogram | per request: its share of the expert bytes fetched |
| moestream_serve_request_expert_stall_seconds | histogram | per request: its share of the time stalled on experts |
| moestream_serve_request_prefetch_hidden_share | histogram | per request: misses whose I/O prefetch hid |

A request's share: each step's change of the source's counters split equally among the step's
sequences (they share one fetch per layer), so the shares of all requests add up to the counters.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
OUTCOMES = ("stop", "length", "cancelled", "error")


class ServeMetrics:
    """Counters the engine updates (from its thread; the client library is thread-safe)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "moestream_serve_"
        self.requests = Counter(p + "requests", "Finished requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)  # present at 0 from the start, so rates work
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.prefix_tokens = Counter(p + "prefix_cached_tokens", "Prompt tokens taken from the prefix cache "
                                     "(not prefilled)", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request accepted to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Time between consecutive tokens of a request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter(p + "steps", "Engine steps (one forward pass over the batch)", registry=r)
        self.step_sequences = Histogram(p + "step_sequences", "Sequences per step",
                                        buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.expert_used = Counter(p + "expert_used_bytes", "Bytes of the distinct experts each step used", registry=r)
        self.expert_fetched = Counter(p + "expert_fetched_bytes", "Expert bytes fetched by the expert source",
                                      registry=r)
        self.running = Gauge(p + "running_sequences", "Sequences in the running batch", registry=r)
        self.waiting = Gauge(p + "waiting_sequences", "Requests waiting for a place in the batch", registry=r)

        self.req_fetched = Histogram(p + "request_expert_fetched_bytes", "Per request: expert bytes fetched (share)",
                                     buckets=tuple(2.0 ** i for i in range(10, 36, 2)), registry=r)
        self.req_stall = Histogram(p + "request_expert_stall_seconds", "Per request: time stalled on experts (share)",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.req_hidden = Histogram(p + "request_prefetch_hidden_share", "Per request: share of misses prefetch hid",
                                    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)

    def observe_share(self, share) -> None:
        """A finished request's ExpertShare (engine.py)."""
        j = share.json()
        self.req_fetched.observe(j["expert_bytes_fetched"])
        self.req_stall.observe(j["expert_stall_s"])
        self.req_hidden.observe(j["prefetch_hidden_share"])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
