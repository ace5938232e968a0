"""Next-token choice: greedy, or temperature / top-k / top-p / min-p sampling with a seeded generator,
after the logit adjustments OpenAI's and vLLM's APIs name (applied in this order, as vLLM does):

| adjustment | on | effect on a token's logit |
|---|---|---|
| logit_bias {id: b} | every token listed | + b (b = -100 bans it, +100 all but forces it) |
| repetition_penalty r | tokens in the prompt or the reply | / r if > 0, x r if < 0 (CTRL's rule) |
| frequency_penalty f | tokens in the reply | - f x (times it appeared) |
| presence_penalty p | tokens in the reply | - p (once, if it appeared) |

Sampling runs on the CPU in float32 whatever the model's device: the logits of one step are
small, and a CPU generator gives the same tokens for the same seed on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    min_p: float = 0.0  # 0 = off; keep tokens at least this share of the most likely one's probability
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def adjusts(self) -> bool:
        """Whether any logit adjustment is on (else the logits are sampled as they come)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row [B, V]; the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches p (always at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
    before = probs.cumsum(-1) - probs  # [B, V] mass of strictly better tokens
    drop_sorted = before >= p  # [B, V]; the first token always has before == 0
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least p x the row's largest (the best always stays)."""
    if p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), float("-inf"))


def adjust_logits(logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    """One sequence's logits [1, V] (float32, cpu) after logit_bias and the three penalties."""
    logits = logits.clone()
    V = logits.shape[-1]
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64)  # [n]
        logits[0, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype)
    if p.repetition_penalty != 1.0 and (prompt or out):
        seen = torch.tensor(sorted(set(prompt) | set(out)), dtype=torch.int64)  # [n]
        vals = logits[0, seen]
        logits[0, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if out and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V)[:V].to(logits.dtype)  # [V]
        logits[0] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


class Sampler:
    """Chooses one token per row of logits [B, V]."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu").manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] on any device -> token ids [B] (int64, cpu)."""
        p = self.params
        if p.greedy:  # argmax where the logits are: only [B] ids cross to the host
            return logits.detach().argmax(-1).cpu()
        logits = logits.detach().float().cpu()  # [B, V]
        logits = filter_min_p(filter_top_p(filter_top_k(logits / p.temperature, p.top_k), p.top_p), p.min_p)
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)  # [B]
