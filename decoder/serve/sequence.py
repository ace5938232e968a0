"""One request inside the engine: what it asks (`GenRequest`), what it emits (token, done and
error events) and its state while it runs (`Sequence`, owned by the engine thread)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..generation.sampling import Sampler, SamplingParams
from .telemetry import ExpertShare


@dataclass
class GenRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # None = off; n = the chosen token's logprob and the n most likely
    grammar: str | None = None  # llguidance grammar the reply must follow (json, tool calls)
    ignore_eos: bool = False  # generate max_tokens whatever the model's stop tokens say


@dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: float | None = None  # of the chosen token, under the model's distribution (no temperature)
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs


@dataclass(frozen=True)
class DoneEvent:
    finish: str  # "stop" (a stop id, or the grammar complete) | "length" | "cancelled"
    experts: dict[str, float] = field(default_factory=dict)  # this request's share (ExpertShare.json)
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


@dataclass(frozen=True)
class ErrorEvent:
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent
Emit = Callable[[Event], None]


def random_seed() -> int:
    return secrets.randbits(63)


class Sequence:
    """One request's state, owned by the engine thread (`cancel` is the one call from outside)."""

    def __init__(self, req: GenRequest, emit: Emit):
        self.req, self.emit = req, emit
        self.sampler = Sampler(req.sampling)
        self.cache: Any = None  # KV cache, allocated on admission
        self.constraint: Any = None  # grammar.Constraint, made on admission when the request has a grammar
        self.share = ExpertShare()
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.stopped_by_text = False  # the reader found a stop string: ends as "stop", not "cancelled"
        self.fed = 0  # prompt tokens already in the cache
        self.out: list[int] = []
        self.cancelled = False  # set from any thread; a plain bool store is atomic
        self.t_submit = time.perf_counter()
        self.t_last = 0.0  # when the last token was sampled

    def cancel(self) -> None:
        self.cancelled = True

    def stop(self) -> None:
        """The reply is complete (a stop string): end it, counted as a stop."""
        self.stopped_by_text = True
        self.cancelled = True

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.req.prompt)

    def next_tokens(self, budget: int) -> list[int]:
        """This step's input: the next prompt chunk (at most `budget` tokens) or the last token."""
        if self.prefilling:
            return self.req.prompt[self.fed:self.fed + budget]
        return [self.out[-1]]


def token_event(tok: int, logits: torch.Tensor, n_top: int | None) -> TokenEvent:
    """The sampled token, with its logprob and the `n_top` most likely ones when asked (logits [V])."""
    if n_top is None:
        return TokenEvent(tok)
    logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top = torch.topk(logp, n_top) if n_top > 0 else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenEvent(tok, float(logp[tok]), pairs)
