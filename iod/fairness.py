"""Fairness between peers: lease quotas that also bind leases already held, recalls, revocations.

A share (peers.py: one user or one process) alone on the daemon may lease the whole arena. Once
another share is connected, each may hold at most `quota` leases (`IodConfig.lease_quota`, never
the whole arena). What a share holds past its *target* is taken back in two steps:

1. recall: the daemon sends `recall` naming the leases it wants, the longest held first (a
   decoder's idle prefetches); an honest decoder releases those it is not computing from;
2. revoke: after `recall_grace_s` whatever of them is still held (and still past the target) is
   released by the daemon itself and the client is told (`recall` with `revoked`): a client that
   ignores recalls, or died without its socket closing, cannot keep the slots.

The target is the quota, and while a demand read has found no free arena slot for
`recall_after_s` (every slot leased or loading), also the fair share
`max(top_k, n_slots // shares)`: a waiting demand request is served in bounded time even when
every share is within its quota.

Runs on the daemon's event loop only.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from moestream.common import protocol as P

if TYPE_CHECKING:
    from .clients import ClientState
    from .server import Server

log = logging.getLogger("moestream.iod")


class Fairness:
    def __init__(self, server: Server):
        self.s = server
        cfg, n_slots = server.cfg, server.arena.n_slots
        self.top_k = server.layout.hparams.n_expert_used
        quota = cfg.lease_quota(n_slots, self.top_k)
        self.quota: float = math.inf if quota is None else quota
        self.grace_s, self.recall_after_s = cfg.recall_grace_s, cfg.recall_grace_s / 2
        self.recalled = self.revoked = 0  # leases, in total

    def quota_for(self, c: ClientState) -> float:
        """A share alone may use the whole arena (nobody to be fair to, and a decoder holding
        prefetched leases must not wait for its own demand behind them)."""
        return self.quota if len(self.s.shares) > 1 else math.inf

    def fair_share(self) -> int:
        return max(self.top_k, self.s.arena.n_slots // max(1, len(self.s.shares)))

    def target(self, now: float) -> float:
        """Leases each share may keep now (see the module docstring)."""
        if len(self.s.shares) <= 1:
            return math.inf
        since = self.s.sched.starved_since
        starved = since is not None and now - since >= self.recall_after_s
        return min(self.quota, self.fair_share()) if starved else self.quota

    def enforce(self, now: float | None = None) -> None:
        """Recall what each share holds past its target, revoke what was not given back in time."""
        now = time.monotonic() if now is None else now
        target = self.target(now)
        revoked = False
        for members in list(self.s.shares.members.values()):
            held = sum(m.held for m in members)
            if held <= target:
                for m in members:
                    m.recalled.clear()  # no longer needed back
                continue
            revoked |= self._revoke_due(members, int(held - target), now)
            held = sum(m.held for m in members)
            owed = int(held - target) - sum(len(m.recalled) for m in members)
            if owed > 0:
                self._recall(members, owed, now)
        if revoked:
            self.s.pump()

    def _recall(self, members: list[ClientState], n: int, now: float) -> None:
        oldest = sorted((c.leased_at[k], i, k) for i, c in enumerate(members) for k in c.oldest_unrecalled(n))[:n]
        by_client: dict[int, list] = {}
        for _, i, key in oldest:
            members[i].recalled[key] = now
            by_client.setdefault(i, []).append(list(key))
        for i, keys in by_client.items():
            c = members[i]
            c.n.recalled += len(keys)
            self.recalled += len(keys)
            self.s.send(c.ident, P.Recall(keys, self.grace_s).encode())

    def _revoke_due(self, members: list[ClientState], excess: int, now: float) -> bool:
        due = sorted((t, i, k) for i, c in enumerate(members) for k, t in c.recalled.items() if now - t >= self.grace_s)
        by_client: dict[int, list] = {}
        for _, i, key in due[:excess]:
            c = members[i]
            for _ in range(c.take_back(key)):
                self.s.cache.release(*key)
            by_client.setdefault(i, []).append(list(key))
        for i, keys in by_client.items():
            c = members[i]
            c.n.revoked += len(keys)
            self.revoked += len(keys)
            log.info("took back %d leases of client %s (pid %d, %s): recalled %.1fs ago and not released",
                     len(keys), P.escape(c.name), c.peer_pid or c.pid, c.share_text(), self.grace_s)
            self.s.send(c.ident, P.Recall(keys, self.grace_s, revoked=True).encode())
        return bool(by_client)

    # -- for people ----------------------------------------------------------------------------
    def quota_int(self) -> int | None:
        return None if math.isinf(self.quota) else int(self.quota)

    def quota_text(self, c: ClientState) -> str:
        """Why `c` waits: what its share holds and claims, against the quota."""
        group = self.s.shares.of(c)
        held = sum(m.held for m in group)
        whose = f"its share ({c.share_text()}, {len(group)} connections)" if len(group) > 1 else "it"
        return (f"{whose} holds {held} leases and has {self.s.shares.claims(c) - held} requests in progress, its "
                f"quota is {self.quota} of the arena's {self.s.arena.n_slots} slots (client_lease_share "
                f"{self.s.cfg.client_lease_share:g})")

    def holders_text(self) -> str:
        """Who pins the arena: leases by client (the biggest first), and reads in progress."""
        held = sorted(((c.held, P.escape(c.name)) for c in self.s.clients.values() if c.held), reverse=True)
        shown = ", ".join(f"{name!r} {n}" for n, name in held[:4]) + (", ..." if len(held) > 4 else "")
        return (f"all {self.s.arena.n_slots} slots are leased or loading ({len(self.s.sched.reading)} reading; "
                f"leases: {shown or 'none'}; each share ({self.s.cfg.fair_by}) may hold "
                f"{self.quota_int() or 'all of them'}, {self.revoked} leases revoked so far)")

    def status(self) -> dict:
        """The `fairness` part of `status`."""
        s = self.s
        return {"client_lease_share": s.cfg.client_lease_share, "client_lease_quota": self.quota_int(),
                "queue_deadline_s": s.cfg.queue_deadline_s,
                "parked": sum(c.n_parked() for c in s.clients.values()),
                "over_quota_total": s.stats.totals.over_quota, "deadline_total": s.stats.totals.deadline,
                "shares": len(s.shares), "fair_by": s.cfg.fair_by, "fair_share": self.fair_share(),
                "recall_grace_s": self.grace_s, "recalled_total": self.recalled, "revoked_total": self.revoked}
