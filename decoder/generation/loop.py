"""Generation loop: prefill, then one token per step for several prompts at once.

Batching is left-padding: prompts are right-aligned in one [B, L] tensor, pads are marked
invalid so attention never sees them, positions count only real tokens, and pad rows skip the
MoE (no expert is fetched for a pad). A sequence that stopped (EOS or length) keeps a row in
the batch but its later tokens are invalid too, so it costs attention only. Greedy results for
a prompt are the same alone or in a batch; sampled ones draw from one generator for the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..kernels.cpu.threads import decode_step
from ..models.layers import KVCache
from ..models.moe_transformer import LayerObserver, MoEModel
from .sampling import Sampler, SamplingParams

OnToken = Callable[[int, int], None]  # (sequence index, token id)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt, the stop token excluded
    finish: list[str]  # "stop" (EOS/EOT) or "length"
    prompt_lengths: list[int]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0  # forward passes after the prefill
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [B, V] (cpu), when kept

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def decode_tok_s(self) -> float:
        """Tokens per second of the decode steps (the prefill's token excluded)."""
        n = sum(max(0, len(t) - 1) for t in self.tokens)
        return n / self.decode_s if self.decode_s > 0 else 0.0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned: tokens [B, L] and valid [B, L]."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
    L = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), L), pad_id, dtype=torch.int64)  # [B, L]
    valid = torch.zeros(len(prompts), L, dtype=torch.bool)  # [B, L]
    for i, p in enumerate(prompts):
        tokens[i, L - len(p):] = torch.tensor(list(p), dtype=torch.int64)
        valid[i, L - len(p):] = True
    return tokens.to(device), valid.to(device)


class _Batch:
    """Per-sequence bookkeeping of one generate() call."""

    def __init__(self, n: int, max_new: int, stop_ids: frozenset[int], on_token: OnToken | None):
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finish = [""] * n
        self.max_new, self.stop_ids, self.on_token = max_new, stop_ids, on_token

    def accept(self, chosen: torch.Tensor) -> None:
        for i, tok in enumerate(chosen.tolist()):
            if self.finish[i]:
                continue
            if tok in self.stop_ids:
                self.finish[i] = "stop"
                continue
            self.tokens[i].append(tok)
            if self.on_token is not None:
                self.on_token(i, tok)
            if len(self.tokens[i]) >= self.max_new:
                self.finish[i] = "length"

    @property
    def done(self) -> bool:
        return all(self.finish)

    def running(self) -> torch.Tensor:
        return torch.tensor([not f for f in self.finish])  # [B] bool


def forward_step(model: MoEModel, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None,
                 observer: LayerObserver | None = None, last_only: bool = False) -> torch.Tensor:
    """One forward pass as its owner runs it: the model's expert bank begins a step (policy decay,
    the last pass's prefetches given up), then the model computes logits (`MoEModel.forward`)."""
    model.bank.begin_step()
    return model.forward(tokens, cache, valid, observer, last_only)


def prefill(model: MoEModel, tokens: torch.Tensor, valid: torch.Tensor, cache: KVCache,
            observer: LayerObserver | None = None, chunk: int | None = None) -> torch.Tensor:
    """The last position's logits [B, V] after the prompts tokens [B, L] (valid [B, L]) went
    through the model `chunk` positions a pass: a pass's buffers (the MoE layer's per-pair rows,
    attention's scores) grow with its positions, so a long prompt in one pass would hold
    hundreds of MB that a chunk holds a fraction of."""
    whole = bool(valid.all())  # no padding: the passes need no row selection (one check)
    L = tokens.shape[1]
    step = L if chunk is None else chunk
    for a in range(0, L, step):
        logits = forward_step(model, tokens[:, a:a + step], cache, None if whole else valid[:, a:a + step], observer,
                              last_only=True)  # [B, V]
    return logits


@torch.inference_mode()
def generate(model: MoEModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), stop_ids: frozenset[int] = frozenset(),
             pad_id: int = 0, on_token: OnToken | None = None, observer: LayerObserver | None = None,
             keep_logits: bool = False, prefill_chunk: int | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt (token ids), stopping each on a stop id, with
    the experts of the model's bank. The prompts are prefilled `prefill_chunk` positions a pass
    (None: all at once)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    tokens, valid = left_pad(prompts, pad_id, model.device)  # [B, L]
    cache = model.new_cache(len(prompts), tokens.shape[1] + max_new_tokens)
    sampler, batch = Sampler(sampling), _Batch(len(prompts), max_new_tokens, stop_ids, on_token)
    result = GenerationResult(batch.tokens, batch.finish, [len(p) for p in prompts])
    t0 = time.perf_counter()
    logits = prefill(model, tokens, valid, cache, observer, prefill_chunk)  # [B, V]
    while True:
        if keep_logits:
            result.logits.append(logits.float().cpu())
        batch.accept(sampler(logits))  # sampling syncs with the device
        if result.steps == 0:
            result.prefill_s = time.perf_counter() - t0
        if batch.done:
            break
        running = batch.running()  # [B]
        step = torch.where(running, latest_tokens(batch), pad_id)[:, None].to(model.device)  # [B, 1]
        valid = None if bool(running.all()) else running[:, None].to(model.device)  # None: no masking, no sync
        with decode_step():  # the CPU kernels' thread count, adapted to the host's load unless fixed
            logits = forward_step(model, step, cache, valid, observer, last_only=True)
        result.steps += 1
    result.decode_s = time.perf_counter() - t0 - result.prefill_s
    return result


def latest_tokens(batch: _Batch) -> torch.Tensor:
    """Each sequence's latest token (0 for one that has none yet; it is masked anyway)."""
    return torch.tensor([t[-1] if t else 0 for t in batch.tokens], dtype=torch.int64)  # [B]


class TextStream:
    """Turns tokens into text pieces per sequence, holding back incomplete UTF-8 characters.

    Each call decodes a short window, not the whole sequence: the tokens since the last
    emitted piece plus the token before them (`_start`) as context, since a token's text may
    depend on its neighbour (a leading space, a byte of a multi-byte character). The piece is
    what the window adds to the text of its context alone.
    """

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[int, str], None]):
        self.decode, self.on_text = decode, on_text
        self.ids: dict[int, list[int]] = {}
        self._start: dict[int, int] = {}  # first token of the context window
        self._read: dict[int, int] = {}  # first token not emitted yet

    def __call__(self, seq: int, token: int) -> None:
        self.ids.setdefault(seq, []).append(token)
        self._emit(seq, final=False)

    def flush(self) -> None:
        """Emit what was held back (a stream that ended inside a character)."""
        for seq in self.ids:
            self._emit(seq, final=True)

    def _emit(self, seq: int, final: bool) -> None:
        ids, start, read = self.ids[seq], self._start.get(seq, 0), self._read.get(seq, 0)
        if read == len(ids):
            return
        context = self.decode(ids[start:read])
        text = self.decode(ids[start:])
        if not final and text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return
        if len(text) > len(context):
            self.on_text(seq, text[len(context):])
        self._start[seq], self._read[seq] = read, len(ids)
