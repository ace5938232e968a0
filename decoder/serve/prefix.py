"""Prefix reuse: the KV caches of finished requests, kept by their token ids, so a request whose
prompt starts with one (the next turn of a chat, a shared system prompt) prefills only the rest.

Bookkeeping apart from storage: `PrefixCache` holds (tokens, cache) entries, least recently used
first, within a byte budget; `seed` copies the matched prefix into the new request's own cache
(entries are never written, so one entry serves any number of requests). A copy costs the bytes
of the prefix's keys and values, far less than recomputing them.

| cache kind | what can be reused |
|---|---|
| KVCache, LatentCache (attention only) | any common prefix of the entry |
| HybridCache (Qwen3-Next / 3.5: a recurrent state) | the whole entry only (the state is the end's) |
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch

MIN_REUSE = 4  # tokens: shorter matches are not worth a lookup's copy


@dataclass
class Entry:
    tokens: torch.Tensor  # [n] int64, cpu: the ids whose keys and values the cache holds
    cache: Any
    nbytes: int


def cache_bytes(cache: Any) -> int:
    """Memory a cache holds (a view, MLA's values inside its keys, counted once)."""
    ts = [*cache.k, *cache.v, cache.valid, *getattr(cache, "conv", []), *getattr(cache, "ssm", [])]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}
    return sum(storages.values())


def recurrent(cache: Any) -> bool:
    return bool(getattr(cache, "conv", None))


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.used = 0
        self._ids = 0

    def put(self, tokens: list[int], cache: Any) -> None:
        """Keep a finished request's cache holding `tokens` (its prompt and the reply fed so far)."""
        if self.budget <= 0 or len(tokens) < MIN_REUSE or cache.length != len(tokens):
            return
        n = cache_bytes(cache)
        if n > self.budget:
            return
        self._ids += 1
        self.entries[self._ids] = Entry(torch.tensor(tokens, dtype=torch.int64), cache, n)
        self.used += n
        while self.used > self.budget:
            _, old = self.entries.popitem(last=False)
            self.used -= old.nbytes

    def match(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` and that length (< len(prompt): the
        last prompt token is always fed, its logits are the first reply token's)."""
        if not self.entries or len(prompt) <= MIN_REUSE:
            return None, 0
        p = torch.tensor(prompt, dtype=torch.int64)
        best, best_n = None, 0
        for key, e in self.entries.items():
            m = min(len(e.tokens), len(p) - 1)
            same = (e.tokens[:m] == p[:m]).int()
            n = int(same.cumprod(0).sum()) if m else 0
            if recurrent(e.cache) and n != len(e.tokens):
                continue  # a recurrent state exists only at the entry's end
            if n > best_n:
                best, best_n = key, n
        if best is None or best_n < MIN_REUSE:
            return None, 0
        self.entries.move_to_end(best)
        return self.entries[best], best_n


def seed(dst: Any, src: Any, n: int) -> None:
    """Copy the first `n` positions of cache `src` into the empty cache `dst` (batch 1, no padding)."""
    for ka, va, kb, vb in zip(dst.k, dst.v, src.k, src.v):
        if ka.shape[2]:  # a recurrent layer keeps no keys
            ka[:, :, :n] = kb[:, :, :n]  # [1, n_kv, n, hd]
        if va.shape[2] and va.data_ptr() != ka.data_ptr():  # MLA's values are a view of its keys
            va[:, :, :n] = vb[:, :, :n]
    for name in ("conv", "ssm"):
        for a, b in zip(getattr(dst, name, []), getattr(src, name, [])):
            a.copy_(b)
    dst.valid[:, :n] = True
    dst.next_pos[:] = n
    dst.length = n
