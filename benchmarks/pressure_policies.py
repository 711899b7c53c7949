"""What the pressure scheduler does when memory runs out: three policies over the same loop.

- `NoHostTier`: radixkv before issue 11. A request is admitted when its blocks fit now with a block of
  headroom per running sequence; on `OutOfBlocks` the latest arrival is released without caching and
  re-opened later, so it prefills again whatever of its prompt and output the tree no longer holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixkv import KVCache, OutOfBlocks

if TYPE_CHECKING:
    from pressure_loop import Counters, Live

NAMESPACE = "default"


class Policy:
    """Admission, victims and preemption; the loop does the rest."""

    name = ""

    def make_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return KVCache(num_blocks, block_size)

    def admit(
        self, cache: KVCache, live: Live, context: np.ndarray, num_running: int, counters: Counters
    ) -> tuple[int, int] | None:
        """Open (or resume) `live`, setting its seq_id; (device hit tokens, host hit tokens), or None when
        it does not fit now."""
        raise NotImplementedError

    def victims(self, cache: KVCache, running: list[Live], num_blocks: int) -> list[Live]:
        """Whom to preempt so that `num_blocks` more blocks are available: the latest arrival (vLLM's
        rule), one at a time."""
        return [max(running, key=lambda live: live.arrival)]

    def preempt(self, cache: KVCache, live: Live, counters: Counters) -> None:
        raise NotImplementedError


class NoHostTier(Policy):
    name = "no host tier, recompute from scratch"

    def __init__(self, watermark: float = 0.01) -> None:
        self.watermark = watermark

    def admit(
        self, cache: KVCache, live: Live, context: np.ndarray, num_running: int, counters: Counters
    ) -> tuple[int, int] | None:
        try:
            taken = cache.check_open([(context, NAMESPACE)])
        except OutOfBlocks:
            return None
        headroom = num_running + int(self.watermark * cache.pool.num_blocks)
        if num_running and cache.num_available_blocks() - taken < headroom:
            return None
        opened = cache.open(context, NAMESPACE)
        live.seq_id = opened.seq_id
        return opened.num_cached_tokens, 0

    def preempt(self, cache: KVCache, live: Live, counters: Counters) -> None:
        cache.release(live.seq_id, cache=False)
        live.seq_id = -1
