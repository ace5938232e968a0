"""Next-token choice: greedy, or temperature / top-k / top-p / min-p sampling with a seeded generator.

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

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

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
