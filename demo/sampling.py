"""Choosing the next token of a sample: greedy, or temperature + top-p (nucleus) from a seeded generator."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """`n` parallel samples of one prompt; temperature 0 is greedy. `seed` makes a request's samples repeatable."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")


def sample_token(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `logprobs` (fp32 `[vocab_size]`); the generator advances only when sampling."""
    if params.temperature == 0:
        return int(logprobs.argmax())
    probs = torch.softmax(logprobs / params.temperature, dim=-1)  # [vocab_size]
    sorted_probs, order = probs.sort(descending=True)  # [vocab_size] each
    # Keep the smallest head of the distribution whose mass reaches top_p (the first token always).
    keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p  # [vocab_size]
    kept = torch.where(keep, sorted_probs, 0.0)  # [vocab_size]
    choice = torch.multinomial(kept / kept.sum(), 1, generator=generator)  # [1]
    return int(order[choice])
