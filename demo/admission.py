"""Continuous batching: which waiting requests a scheduler step admits, and how many of their tokens it computes.

A step computes its decodes (one token per live sequence) and the uncached tails of the prompts it
admits, up to `max_batch_tokens` in all (vLLM's `max_num_batched_tokens`). Three rules on top:

- First come, first served: a request that does not fit stops admission for this step; none jumps it.
- In-batch prefix sharing (after SGLang's rule): a request that shares more full blocks with a prompt
  admitted in this very step than the cache holds, by at least half of what it would compute, waits one
  step and then hits that prompt's blocks instead of computing them twice. (A smaller share is not worth
  a step's delay.)
- Memory: a request is admitted only while the pool keeps a block of headroom per live sequence
  (their next appends), so admission does not force the preemptions it could foresee.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class Prober(Protocol):
    def match(self, token_ids: list[int], namespace: str) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """The policy's parameters: the step's token budget and the pool's block size."""

    max_batch_tokens: int
    block_size: int
    defer_shared: bool = True  # the in-batch sharing rule; off when nothing is ever cached

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")

    def choose(
        self,
        contexts: list[list[int]],
        prober: Prober,
        namespace: str,
        num_decodes: int,
        num_available_blocks: int,
    ) -> list[int]:
        """Indices (into `contexts`, the waiting requests' tokens in arrival order) to admit now.

        Args:
            num_decodes: live sequences; each costs one token of the budget and one block of headroom.
            num_available_blocks: free plus evictable blocks of the pool.
        """
        budget = self.max_batch_tokens - num_decodes
        headroom = num_available_blocks - num_decodes
        chosen: list[int] = []
        for i, tokens in enumerate(contexts):
            cached = prober.match(tokens, namespace)
            num_new = len(tokens) - max(cached, 0)
            if self.defer_shared and any(
                2 * (self._shared_full_blocks(tokens, contexts[j]) - cached) >= num_new for j in chosen
            ):
                continue  # most of its prefix is being computed now: next step it hits
            num_blocks = -(-len(tokens) // self.block_size) - cached // self.block_size
            alone = not chosen and num_decodes == 0  # nothing else runs: admit it whatever it costs
            if not alone and (num_new > budget or num_blocks + 1 > headroom):
                break
            chosen.append(i)
            budget -= num_new
            headroom -= num_blocks + 1
        return chosen

    def _shared_full_blocks(self, a: list[int], b: list[int]) -> int:
        """Tokens of the common prefix of `a` and `b`, in whole blocks (what a cache could share)."""
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n // self.block_size * self.block_size
