"""The engine: one thread owns the model and the expert source; requests join and leave the batch
between steps (continuous batching, after nano-vllm's `step()`: schedule -> run -> postprocess).

A `Sequence` is one request: `waiting` (queued) -> `running` (prefill in chunks, then one token
per step) -> finished (stop id, max_tokens, cancelled or error). Other threads only `submit` and
`cancel`; everything else happens on the engine thread, because the model and the expert source
(an IodClient, numba kernels over leased slots) are not thread-safe. Results go back through the
`emit` callback each request gave (an asyncio queue for the server, a plain queue for `chat`).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..experts.bank import ExpertBank
from ..models.moe_transformer import MoEModel
from ..generation.sampling import adjust_logits
from .http.metrics import ServeMetrics
from .prefix import MIN_REUSE, PrefixCache, seed
from .sequence import DoneEvent, Emit, ErrorEvent, Event, GenRequest, Sequence, TokenEvent, random_seed, token_event
from .telemetry import StepExperts, expert_counters

__all__ = ["Engine", "GenRequest", "TokenEvent", "DoneEvent", "ErrorEvent", "Sequence", "random_seed", "open_parts"]

if TYPE_CHECKING:
    from ...common.layout import ModelLayout
    from .config import ServeConfig

log = logging.getLogger("moestream.serve")


@dataclass
class Parts:
    """What the engine thread builds at start: model (holding its expert bank), observer, stop ids."""

    model: MoEModel
    observer: StepExperts
    stop_ids: frozenset[int]

    @property
    def bank(self) -> ExpertBank:
        return self.model.bank


class Engine:
    def __init__(self, build: Callable[[], Parts], *, max_seqs: int, max_step_tokens: int,
                 metrics: ServeMetrics | None = None, grammars: Callable[[], Any] | None = None,
                 prefix_cache_bytes: int = 0):
        self._build, self.max_seqs, self.max_step_tokens = build, max_seqs, max_step_tokens
        self._grammars = grammars  # -> grammar.GrammarBook, for requests with a grammar
        self._drain_at: float | None = None  # shutting down: running sequences end at this time
        self.prefixes = PrefixCache(prefix_cache_bytes)  # engine thread only
        self.metrics = metrics or ServeMetrics()
        self.parts: Parts | None = None
        self.inbox: queue.SimpleQueue[Sequence | None] = queue.SimpleQueue()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._traffic: dict[str, float] | None = None  # the bank's counters after the last step (engine thread)
        self.failure: str | None = None  # set when the engine can no longer run (the source is gone)
        self._stop = False
        self._start_error: BaseException | None = None  # what failed while building the parts
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="moestream-engine", daemon=True)

    # -- other threads -----------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> None:
        """Start the thread and wait until model and source are loaded; re-raise what failed."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"engine did not start within {timeout_s:.0f} s")
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def submit(self, req: GenRequest, emit: Emit) -> Sequence:
        seq = Sequence(req, emit)
        self.inbox.put(seq)
        return seq

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    @property
    def draining(self) -> bool:
        return self._drain_at is not None

    def shutdown(self, grace_s: float) -> None:
        """Admit nothing more; sequences still running after `grace_s` end with an error event."""
        self._drain_at = time.monotonic() + grace_s
        self.inbox.put(None)  # wake the loop

    def source_down(self) -> str | None:
        """Why a request now would only wait (the daemon connection is not up), cheaply: no ping."""
        client = self.parts.bank.client if self.parts is not None else None
        state = client.state.value if client is not None else "connected"
        return None if state == "connected" else f"moestream-iod at {client.endpoint} is unreachable ({state})"

    def unreachable(self) -> str | None:
        """Why the expert source cannot serve now (a daemon that is gone or reconnecting), or None."""
        client = self.parts.bank.client if self.parts is not None else None
        if client is None:
            return None
        if (down := self.source_down()) is not None:
            return down
        try:
            client.ping(timeout_s=2.0)
        except Exception as e:
            return f"moestream-iod at {client.endpoint} does not answer: {e}"
        return None

    def stats(self) -> dict[str, Any]:
        """The expert source's counters (read from another thread: a snapshot, good enough to print)."""
        return self.parts.bank.stats().as_dict() if self.parts is not None else {}

    def close(self) -> None:
        self._stop = True
        self.inbox.put(None)
        if self._thread.is_alive():
            self._thread.join()

    # -- the engine thread -------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.parts = self._build()
        except BaseException as e:  # handed to start()
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            with torch.inference_mode():
                self._loop()
        finally:
            self._finish_all(DoneEvent("cancelled"))
            self.parts.bank.close()

    def _loop(self) -> None:
        while not self._stop:
            self._admit(block=not self.running and not self.draining)
            if self._drain_at is not None and time.monotonic() >= self._drain_at:
                for seq in list(self.running):
                    self._finish(seq, ErrorEvent("the server is shutting down"), "cancelled")
            if self.running:
                self.step()
            elif self.draining:
                time.sleep(0.01)

    def _admit(self, block: bool) -> None:
        """Take new requests from the inbox; move waiting ones into the batch while there is room."""
        try:
            item = self.inbox.get() if block else self.inbox.get_nowait()
            while True:
                if item is not None:
                    self.waiting.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass
        for seq in [s for s in self.waiting if s.cancelled]:  # gone before they got a place
            self.waiting.remove(seq)
            self._finish(seq, DoneEvent("cancelled"), "cancelled")
        while self.waiting and self.draining:
            self._finish(self.waiting.popleft(), ErrorEvent("the server is shutting down"), "cancelled")
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting.popleft()
            if seq.req.grammar is not None and not self._constrain(seq):
                continue
            seq.cache = self.parts.model.new_cache(1, len(seq.req.prompt) + seq.req.max_tokens)
            self._reuse_prefix(seq)
            self.running.append(seq)
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))

    def _reuse_prefix(self, seq: Sequence) -> None:
        entry, n = self.prefixes.match(seq.req.prompt)
        if entry is not None:
            seed(seq.cache, entry.cache, n)
            seq.fed = seq.cached = n
            self.metrics.prefix_tokens.inc(n)

    def _keep_prefix(self, seq: Sequence) -> None:
        """A finished request's cache, for a later prompt that starts the same way."""
        c = seq.cache
        if not self.prefixes.budget or c.length < MIN_REUSE:
            return
        kept = self.parts.model.new_cache(1, c.length)  # only what it holds, not the request's capacity
        seed(kept, c, c.length)
        self.prefixes.put((seq.req.prompt + seq.out)[:c.length], kept)

    def _constrain(self, seq: Sequence) -> bool:
        try:
            seq.constraint = self._grammars().constraint(seq.req.grammar)
            return True
        except Exception as e:  # checked at request time; a failure here ends this request only
            self._finish(seq, ErrorEvent(f"grammar: {e}"), "error")
            return False

    def step(self) -> None:
        """Schedule -> run -> postprocess, for every running sequence at once."""
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, DoneEvent("cancelled"), "cancelled")
        batch = self._schedule()
        if not batch:
            return
        try:
            logits = self._run(batch)  # [S, V]
        except Exception as e:  # the step failed for all of its sequences (e.g. the daemon went away)
            log.error("step failed: %s", e)
            self._fail_step(batch, e)
            return
        self._postprocess(batch, logits)

    def _schedule(self) -> list[tuple[Sequence, list[int]]]:
        """Decoding sequences first (one token each), then prefill chunks within the token budget."""
        decoding = [(s, s.next_tokens(1)) for s in self.running if not s.prefilling]
        budget, batch = self.max_step_tokens - len(decoding), decoding
        for s in (s for s in self.running if s.prefilling):
            if budget <= 0:
                break
            chunk = s.next_tokens(budget)
            batch.append((s, chunk))
            budget -= len(chunk)
        return batch

    def _run(self, batch: list[tuple[Sequence, list[int]]]) -> torch.Tensor:
        p = self.parts
        dev = p.model.device
        steps = [(torch.tensor([toks], dtype=torch.int64, device=dev), s.cache) for s, toks in batch]  # [1, T_i]
        client = p.bank.client
        before_used = p.observer.bytes
        # From the last step's counters, not fresh ones: a prefetch that lands between two steps
        # (asked for by the first, or cancelled and fetched anew) is the next step's, never nobody's.
        before = self._traffic or expert_counters(p.bank.stats(), getattr(client, "bytes_received", None))
        p.bank.begin_step()  # the engine owns the step: sequences joined and left before it
        logits = p.model.forward_many(steps, p.observer)  # [S, V]
        after = self._traffic = expert_counters(p.bank.stats(), getattr(client, "bytes_received", None))
        deltas = {k: max(0.0, after[k] - before[k]) / len(batch) for k in after}
        used = p.observer.bytes - before_used
        for s, _ in batch:
            s.share.add(used / len(batch), deltas)
        m = self.metrics
        m.steps.inc()
        m.step_sequences.observe(len(batch))
        m.expert_used.inc(used)
        m.expert_fetched.inc(deltas["expert_bytes_fetched"] * len(batch))
        return logits

    def _postprocess(self, batch: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> None:
        for row, (seq, toks) in enumerate(batch):
            if seq.prefilling:
                seq.fed += len(toks)
                self.metrics.prompt_tokens.inc(len(toks))
                if seq.prefilling:
                    continue  # more of the prompt to go: these logits are not the next token's
            self._sample(seq, logits[row:row + 1])  # [1, V]

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        tok = int(seq.sampler(self._adjusted(seq, logits))[0])
        now = time.perf_counter()
        m = self.metrics
        if seq.t_last:
            m.tpot.observe(now - seq.t_last)
        else:
            m.ttft.observe(now - seq.t_submit)
        seq.t_last = now
        if tok in self.parts.stop_ids and not (seq.req.ignore_eos and seq.constraint is None):
            self._finish(seq, DoneEvent("stop"), "stop")
            return
        if seq.constraint is not None and not seq.constraint.accept(tok):
            self._finish(seq, ErrorEvent(f"grammar rejected token {tok}: {seq.constraint.error}"), "error")
            return
        seq.out.append(tok)
        m.generation_tokens.inc()
        self._emit(seq, token_event(tok, logits[0], seq.req.logprobs))
        if seq.constraint is not None and seq.constraint.finished:
            self._finish(seq, DoneEvent("stop"), "stop")
        elif len(seq.out) >= seq.req.max_tokens:
            self._finish(seq, DoneEvent("length"), "length")

    def _adjusted(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] after the request's logit bias, penalties, grammar mask and ignore_eos."""
        p = seq.req.sampling
        if not (p.adjusts or seq.constraint is not None or seq.req.ignore_eos):
            return logits
        out = adjust_logits(logits.detach().float().cpu(), p, seq.req.prompt, seq.out)  # [1, V]
        if seq.constraint is not None:
            out = seq.constraint.mask(out)
        elif seq.req.ignore_eos:
            out[0, sorted(self.parts.stop_ids)] = float("-inf")
        return out

    def _emit(self, seq: Sequence, ev: Event) -> None:
        try:
            seq.emit(ev)
        except Exception:  # the receiver is gone (its event loop closed): nobody waits for more
            seq.cancel()

    def _finish(self, seq: Sequence, ev: Event, outcome: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if outcome == "cancelled" and seq.stopped_by_text:
            outcome = "stop"
        if outcome in ("stop", "length") and seq.cache is not None and not seq.prefilling:
            self._keep_prefix(seq)
        seq.cache = seq.constraint = None  # the request's own reference goes; the prefix cache may keep it
        if isinstance(ev, DoneEvent):
            ev = DoneEvent(ev.finish, seq.share.json(), seq.cached)
        self.metrics.requests.labels(outcome).inc()
        self.metrics.observe_share(seq.share)
        self.metrics.running.set(len(self.running))
        self._emit(seq, ev)

    def _fail_step(self, batch: list[tuple[Sequence, list[int]]], e: Exception) -> None:
        from ...common.client import IodUnavailable

        if isinstance(e, IodUnavailable):
            self.failure = f"expert source unavailable: {e}"
            self._stop = True
        for seq, _ in batch:
            self._finish(seq, ErrorEvent(f"generation failed: {e}"), "error")

    def _finish_all(self, ev: Event) -> None:
        for seq in list(self.running) + list(self.waiting):
            self._finish(seq, ErrorEvent(self.failure) if self.failure else ev,
                         "error" if self.failure else "cancelled")
        self.waiting.clear()
        while True:
            try:
                seq = self.inbox.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                self._finish(seq, ev, "cancelled")


def open_parts(cfg: ServeConfig, layout: ModelLayout, stop_ids: frozenset[int],
               name: str = "moestream-serve") -> Parts:
    """Model, expert source and observer for a `ServeConfig`, opened as `moestream generate` opens
    them (called on the engine thread, which then owns them)."""
    from ..cli import open_resident, open_streamed, prefetcher, use_threads
    from ..models import load_model

    dc = cfg.decoder_config()
    use_threads(dc.threads)  # this (the engine) thread's compute
    model = load_model(layout, dc.torch_device, dc.torch_dtype, progress=dc.progress,
                       keep_quantized=dc.resolved_slot_format == "quant", kv_dtype=dc.torch_kv_dtype)
    backend = open_resident(dc, layout) if dc.resident else open_streamed(dc, layout, name)
    model = model.with_bank(ExpertBank(backend))
    blob_bytes = [layout.experts.blob_bytes(i) for i in range(layout.hparams.n_layer)]
    return Parts(model, StepExperts(blob_bytes, prefetcher(dc, model)), stop_ids)
