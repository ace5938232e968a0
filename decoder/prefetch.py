"""Prefetch ahead of time: predict the next layers' experts and land them off the compute path.

`Prefetcher` is the model's `after_layer` hook: after layer L it applies the routers of
layers L+1..L+d to the current hidden state (the residual stream changes slowly from one
layer to the next, so this predicts most of the real routing), takes the top-k, and hints
the expert source, which sends `fetch ahead` for the predicted experts that are not resident.

`Receiver` is the thread that lands those fetches: it waits on the client's futures, copies
each expert from the shared-memory arena into its device slot (on CUDA the slot cache puts
the copy on a side stream and records an event the compute stream waits on), and hands the
lease back. The compute thread never copies a prefetched expert; it waits only when it needs
one that has not landed yet.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..common.client import IodClient
from .slot_cache import DeviceSlotCache, Key

log = logging.getLogger("moestream.prefetch")

Landed = Callable[[Key, int, BaseException | None], None]  # (key, bytes copied, error or None)


class Receiver:
    """Copies fetched experts from the arena into the slot cache, on its own thread."""

    def __init__(self, client: IodClient, cache: DeviceSlotCache, on_landed: Landed | None = None):
        self.client, self.cache, self.on_landed = client, cache, on_landed
        self._queue: queue.SimpleQueue[tuple[Key, cf.Future] | None] = queue.SimpleQueue()
        self._outstanding = 0  # futures submitted and not yet handled
        self._cond = threading.Condition()
        self.landed = self.failed = self.bytes = 0
        self.copy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="moestream-receiver", daemon=True)
        self._thread.start()

    def submit(self, key: Key, future: cf.Future) -> None:
        """Land `future`'s lease into `key`'s claimed slot when it completes."""
        with self._cond:
            self._outstanding += 1
        future.add_done_callback(lambda f: self._queue.put((key, f)))  # runs on the client's I/O thread

    @property
    def outstanding(self) -> int:
        with self._cond:
            return self._outstanding

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted future has been handled; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return not self._outstanding
        return True

    def close(self, timeout: float = 5.0) -> None:
        self.drain(timeout)
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, future = item
            try:
                self._land(key, future)
            except Exception:  # never let one expert kill the thread that lands all of them
                log.exception("receiver: landing %s failed", key)
            finally:
                with self._cond:
                    self._outstanding -= 1
                    self._cond.notify_all()

    def _land(self, key: Key, future: cf.Future) -> None:
        err: BaseException | None = None
        nbytes = 0
        try:
            lease = future.result()
        except BaseException as e:  # cancelled, request error, daemon gone
            err = e
        else:
            t0 = time.perf_counter()
            try:
                parts = {name: self.client.part_view(lease, name) for name in lease.parts}
                self.cache.write(key, parts)
                self.cache.unpin(key)  # the in-flight pin; the source's hold pin stays until its layer runs
                nbytes = sum(n for _, n in lease.parts.values())
            except BaseException as e:
                err = e
            finally:
                self.client.release(lease)
            self.copy_s += time.perf_counter() - t0
        if err is not None:
            self.cache.abort(key)
            self.failed += 1
        else:
            self.landed += 1
            self.bytes += nbytes
        if self.on_landed is not None:
            self.on_landed(key, nbytes, err)


class Prefetcher:
    """The model's `after_layer` hook: hint the next `depth` layers' predicted experts.

    `source` is any `ExpertSource`; its `prefetch(layer, experts)` decides what to fetch.
    """

    def __init__(self, model: Any, source: Any, depth: int = 1, top_k: int | None = None):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch depth must be an int >= 0, got {depth!r}")
        hp = model.hparams
        self.model, self.source, self.depth = model, source, depth
        self.top_k = top_k or hp.n_expert_used
        self.n_layer = hp.n_layer
        self.predictions = 0  # (layer, expert) keys predicted
        self.predict_s = 0.0

    @torch.inference_mode()
    def __call__(self, layer: int, h: torch.Tensor) -> None:
        """After `layer`: h [n, d] are the real tokens' hidden rows."""
        if h.shape[0] == 0:
            return
        t0 = time.perf_counter()
        for nxt in range(layer + 1, min(layer + 1 + self.depth, self.n_layer)):
            logits = self.model.router_logits(nxt, h)  # [n, E]
            ids = torch.topk(logits, self.top_k, dim=-1).indices  # [n, k]; softmax keeps the order
            experts = sorted(set(ids.flatten().tolist()))
            self.predictions += len(experts)
            self.source.prefetch(nxt, experts)
        self.predict_s += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {"depth": self.depth, "predictions": self.predictions, "predict_s": self.predict_s}
