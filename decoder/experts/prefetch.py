"""Prefetch ahead of time: predict the next layers' experts and land them off the compute path.

`Prefetcher` observes the forward pass (a `LayerObserver`): after layer L it applies the routers of
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

import torch

from ...common.client import IodClient
from .bank import ExpertBank
from .source import ExpertBackend
from .stats import PrefetcherStats
from ..models.moe_transformer import LayerObserver, MoEModel
from .gpu.slot_cache import DeviceSlotCache, Key

log = logging.getLogger("moestream.prefetch")

class Receiver:
    """Lands fetched experts from the arena into the slot cache, on its own thread.

    The compute thread may take over a landing (`land_here`): when it needs an expert whose
    lease is in but that the thread has not started on, copying it itself beats waking the
    thread and waiting (on a CPU, dequantizing competes for the same cores and the GIL
    anyway). Whoever `_take`s a key first lands it; the other one skips it.
    """

    def __init__(self, client: IodClient, cache: DeviceSlotCache):
        self.client, self.cache = client, cache
        self._queue: queue.SimpleQueue[tuple[Key, cf.Future] | None] = queue.SimpleQueue()
        self._outstanding = 0  # futures submitted and not yet handled
        self._cond = threading.Condition()
        self._submitted: set[cf.Future] = set()  # not handled yet (futures: a key may come back later)
        self._taken: set[cf.Future] = set()  # submitted, and someone has started landing it
        self.bytes = self.stolen = 0  # bytes landed here, landings the compute thread took over
        self.copy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="moestream-receiver", daemon=True)
        self._thread.start()

    def submit(self, key: Key, future: cf.Future) -> None:
        """Land `future`'s lease into `key`'s claimed slot when it completes."""
        with self._cond:
            self._outstanding += 1
            self._submitted.add(future)
        future.add_done_callback(lambda f: self._queue.put((key, f)))  # runs on the client's I/O thread

    def land_here(self, key: Key, future: cf.Future, timeout: float) -> bool:
        """On the calling thread: wait for `future` and land it, unless the receiver thread
        already took it (then False: wait on the slot instead). Raises on timeout."""
        if not self._take(future):
            return False
        try:
            future.result(timeout)
        except cf.TimeoutError:
            self._untake(future)
            raise
        except BaseException:
            pass  # failed or cancelled: `_land` aborts the entry and waiters see FetchFailed
        self.stolen += 1
        self._land(key, future)
        return True

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

    def _take(self, future: cf.Future) -> bool:
        with self._cond:
            if future not in self._submitted or future in self._taken:
                return False
            self._taken.add(future)
            return True

    def _untake(self, future: cf.Future) -> None:
        with self._cond:
            self._taken.discard(future)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, future = item
            try:
                if self._take(future):
                    self._land(key, future)
            except Exception:  # never let one expert kill the thread that lands all of them
                log.exception("receiver: landing %s failed", key)
            finally:
                with self._cond:
                    self._outstanding -= 1
                    self._taken.discard(future)
                    self._submitted.discard(future)
                    self._cond.notify_all()

    def _land(self, key: Key, future: cf.Future) -> None:
        try:
            lease = future.result(0)
        except BaseException:  # cancelled, request error, daemon gone: waiters see FetchFailed
            self.cache.abort(key)
            return
        t0 = time.perf_counter()
        try:
            parts = {name: self.client.part_view(lease, name) for name in lease.parts}
            self.cache.write(key, parts)
            self.cache.unpin(key, "fill")  # the in-flight pin; the source's hold pin stays until its layer runs
            self.bytes += sum(n for _, n in lease.parts.values())
        except BaseException:
            self.cache.abort(key)
        finally:
            self.client.release(lease)
            self.copy_s += time.perf_counter() - t0


class Prefetcher(LayerObserver):
    """Observes the forward pass and hints the next `depth` layers' predicted experts.

    `at` picks when a prediction is made:
    - ``"layer"``: after layer L, from its output (the most accurate guess, but only layer
      L+1's attention is left to hide the fetch behind);
    - ``"attention"``: after layer L's attention, from the post-attention residual (a less
      accurate guess, but the fetch overlaps all of layer L's MoE block). The source sends it
      once layer L's own experts are pinned and its misses requested (`prefetch_ahead(...,
      defer=True)`), so a prefetch never evicts what the current layer is about to use.
    `bank` is the model's `ExpertBank` (or a backend): `prefetch_ahead` gets all of a call's layers
    at once. The owner of the pass (generation loop, serve engine) passes this observer in: the
    model itself never plans prefetches.
    """

    AT = ("layer", "attention")

    def __init__(self, model: MoEModel, bank: ExpertBank | ExpertBackend, depth: int = 1, top_k: int | None = None, at: str = "layer"):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch depth must be an int >= 0, got {depth!r}")
        if at not in self.AT:
            raise ValueError(f"prefetch point must be one of {self.AT}, got {at!r}")
        hp = model.hparams
        self.model, self.bank, self.depth, self.at = model, bank, depth, at
        self.k = hp.n_expert_used
        self._top_k = top_k  # fetched ahead (None: the source's width, asked each time); the rest if cached
        self.n_layer = hp.n_layer
        self.predictions = 0  # (layer, expert) keys predicted
        self.predict_s = 0.0
        self.hints = self.wide = 0  # hints made, and those that fetched more than each token's top-1

    @property
    def top_k(self) -> int:
        """Each token's guesses per predicted layer fetched ahead: the user's, else the source's now."""
        return min(self._top_k or self.bank.prefetch_top(self.k), self.k)

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        """After `layer`: h [n, d] are the real tokens' hidden rows."""
        if self.at == "layer":
            self._hint(layer, h, defer=False)

    def after_attention(self, layer: int, h: torch.Tensor) -> None:
        """After `layer`'s attention, before its MoE block: h [n, d] real tokens' residual rows."""
        if self.at == "attention":
            self._hint(layer, h, defer=True)

    @torch.inference_mode()
    def _hint(self, layer: int, h: torch.Tensor, defer: bool) -> None:
        hp = self.model.hparams
        # a dense layer (DeepSeek's leading ones) has no router and no experts to fetch
        layers = [nxt for nxt in range(layer + 1, min(layer + 1 + self.depth, self.n_layer)) if hp.is_moe_layer(nxt)]
        if h.shape[0] == 0 or not layers:
            return
        t0 = time.perf_counter()
        # top-k of the router logits: softmax keeps their order
        ids = [torch.topk(self.model.router_logits(nxt, h), self.k, dim=-1).indices for nxt in layers]  # [n, k]
        picked = torch.stack(ids).tolist()  # [layers][n][k]: one host sync for all of them
        top = self.top_k
        predictions = {nxt: sorted({e for row in rows for e in row[:top]}) for nxt, rows in zip(layers, picked)}
        if_cached = {nxt: sorted({e for row in rows for e in row[top:]} - set(predictions[nxt]))
                     for nxt, rows in zip(layers, picked)}
        self.predictions += sum(len(es) for es in predictions.values())
        self.hints += 1
        self.wide += top > 1
        self.bank.prefetch_ahead(predictions, defer=defer, if_cached=if_cached)
        self.predict_s += time.perf_counter() - t0

    def stats(self) -> PrefetcherStats:
        return PrefetcherStats(self.depth, self.at, self.predictions, self.predict_s, self.hints, self.wide)
