"""The lease pipeline: how a layer gets the leases of the experts it must fetch, batched per layer.

`LeasePipeline.request(layer, fresh, joined)` sends one `fetch now` for the `fresh` experts and
adopts the `joined` futures (prefetches already in flight or landed); `arrivals(owed)` yields
{expert: lease} for each batch of leases that came together, and fetches `now` again whatever
came back refused, dropped, cancelled or void (a lost daemon's lease), so the caller only ever
sees good leases; `refetch(owed, e, why)` is that retry for a reason the caller found (its
compute read a void lease, a lease-free read saw its slot change). Bounded: a request refused
`MAX_RETRIES` times in a row, or waiting for arena room (`deadline`) longer than
`fetch_timeout_s` in all, raises `IodUnavailable` naming the expert and why.

Used by the CPU arena backend (`arena.ArenaExperts`) and the zero-copy GPU backend
(`zero_copy.ArenaGpuExperts`); its counters are `stats.LeaseCounters`.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ...common import protocol as P
from ...common.client import IodClient, IodRequestError, IodUnavailable, Lease
from .stats import LeaseCounters

RETRYABLE = P.GIVEN_UP | {P.ErrorCode.BUSY.value, P.ErrorCode.DEADLINE.value}  # fetched again `now`
# (busy: after a back-off; deadline: the daemon waited for room already, within a total bound)
MAX_RETRIES = 20  # a request refused this often in a row means the daemon is overloaded


@dataclass
class Owed:
    """One layer call's experts still owed: {future: expert}, and how often each was retried."""

    layer: int
    pending: dict[cf.Future, int] = field(default_factory=dict)
    retries: dict[int, int] = field(default_factory=dict)


class LeasePipeline:
    """Fetch, join, retry and void handling for one client's layers (see the module docstring)."""

    def __init__(self, client: IodClient, counts: LeaseCounters, fetch_timeout_s: float = 60.0):
        self.client, self.counts, self.fetch_timeout_s = client, counts, fetch_timeout_s
        self._deadline_since: dict[tuple[int, int], float] = {}  # expert -> its first `deadline` in a row

    def begin_step(self) -> None:
        self._deadline_since.clear()

    def request(self, layer: int, fresh: list[int], joined: dict[int, cf.Future] | None = None,
                uses: dict[int, int] | None = None) -> Owed:
        """One `fetch now` for `fresh`, plus the `joined` futures: what the layer is owed. `uses`:
        the rows of the step each expert serves (the daemon's policy weighs them; a retry does not)."""
        owed = Owed(layer, {f: e for e, f in (joined or {}).items()})
        if fresh:
            futures = self.client.fetch([(layer, e) for e in fresh], "now",
                                        None if uses is None else [uses[e] for e in fresh])
            owed.pending.update(zip(futures, fresh))
            self.counts.demand += len(fresh)
        return owed

    def arrivals(self, owed: Owed) -> Iterator[dict[int, Lease]]:
        """{expert: lease} per batch that arrived together; each future leaves `owed` once handled."""
        while owed.pending:
            t0 = time.perf_counter()
            done, _ = cf.wait(list(owed.pending), timeout=self.fetch_timeout_s, return_when=cf.FIRST_COMPLETED)
            self.counts.stall_s += time.perf_counter() - t0
            if not done:
                raise IodUnavailable(f"experts of layer {owed.layer} {sorted(owed.pending.values())} not delivered "
                                     f"within {self.fetch_timeout_s}s")
            leases = {}
            for f in done:
                e = owed.pending.pop(f)
                lease = self._lease_or_retry(owed, e, f)
                if lease is not None:
                    self.counts.bytes_fetched += sum(n for _, n in lease.parts.values())
                    leases[e] = lease
            if leases:
                yield leases

    def refetch(self, owed: Owed, e: int, why: str, exc: BaseException | None = None) -> None:
        """Fetch `e` again `now`: dropped, refused as busy or for lack of room, cancelled, its
        lease void (`voided`), or its lease-free read overtaken by a reload (`changed`)."""
        if why == P.ErrorCode.DEADLINE.value:  # bounded by time, not by count
            self._waited_deadline(owed.layer, e, exc)
        else:
            owed.retries[e] = owed.retries.get(e, 0) + 1
            if owed.retries[e] > MAX_RETRIES:
                raise IodUnavailable(f"expert ({owed.layer}, {e}) refused {MAX_RETRIES} times in a row: {exc or why}")
        if why == P.ErrorCode.BUSY.value:
            time.sleep(min(0.001 * 2 ** owed.retries[e], 0.1))  # the daemon's queue is full: back off
        owed.pending[self.client.fetch([(owed.layer, e)], "now")[0]] = e
        if why == "voided":
            self.counts.voided += 1
        elif why == "changed":
            self.counts.changed += 1
        else:
            self.counts.refetched += 1

    def give_up(self, owed: Owed) -> None:
        """The layer failed: cancel what is in flight (one message), hand back leases that came."""
        futures = list(owed.pending)
        owed.pending.clear()
        self.client.cancel([f for f in futures if not f.done()])  # a lease arriving later goes back
        self.client.release_many([f.result() for f in futures
                                  if f.done() and not f.cancelled() and f.exception() is None])

    def _lease_or_retry(self, owed: Owed, e: int, f: cf.Future) -> Lease | None:
        try:
            lease = f.result()
        except (cf.CancelledError, IodRequestError) as exc:
            code = getattr(exc, "code", "cancelled")
            if code != "cancelled" and code not in RETRYABLE:
                raise
            self.refetch(owed, e, code, exc)
            return None
        if self.client.voided(lease):  # landed before the daemon was lost (a prefetch): ask the new one
            self.refetch(owed, e, "voided")
            return None
        self._deadline_since.pop((owed.layer, e), None)
        return lease

    def _waited_deadline(self, layer: int, e: int, exc: BaseException | None) -> None:
        """The daemon gave up waiting for arena room (`deadline`): others hold it. Ask again, until
        `fetch_timeout_s` of such waits in a row for this expert."""
        now = time.monotonic()
        waited = self.client.welcome.get("queue_deadline_s", 0.0)
        first = self._deadline_since.setdefault((layer, e), now - waited)
        message = getattr(exc, "message", str(exc))
        self.counts.deadlines += 1
        self.counts.deadline_wait_s += waited
        self.counts.waited_on = message[:300]
        if now - first > self.fetch_timeout_s:
            raise IodUnavailable(f"expert ({layer}, {e}): no arena room for {now - first:.0f}s "
                                 f"(fetch timeout {self.fetch_timeout_s:g}s): {message}")
