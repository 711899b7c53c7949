"""What the pressure scheduler does when memory runs out: three policies over the same loop.

- `NoHostTier`: radixkv before issue 11. A request is admitted when its blocks fit now with a block of
  headroom per running sequence; on `OutOfBlocks` the latest arrival is released without caching and
  re-opened later, so it prefills again whatever of its prompt and output the tree no longer holds.
- `PreemptRecompute`: admission by token budget (each request states its output length, and
  `RESERVE_FRACTION` of that growth is reserved, so the pool is overcommitted); on `OutOfBlocks` the
  core's `victims` are preempted by recompute: their computed blocks are published to the tree and
  `resume` re-matches what is still cached under the same sequence id.
- `PreemptSwap`: the same admission and victims over a pool with a host tier `HOST_FACTOR` times its
  size: victims are preempted by swap (their own blocks move to the host tier and come back on resume;
  by recompute when the host tier cannot take them), and prefixes the device evicts are written back to
  the host tier, so a request that comes back loads them rather than computing them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixkv import KVCache, OpenResult, OutOfBlocks
from radixkv.errors import NotAdmitted

if TYPE_CHECKING:
    from pressure_loop import Counters, Live

NAMESPACE = "default"
RESERVE_FRACTION = 0.25  # of each request's stated growth reserved at admission: the rest relies on preemption
HOST_FACTOR = 4  # the host tier holds this many times the device pool


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

    def resume(self, cache: KVCache, live: Live, counters: Counters) -> int | None:
        """Bring back a sequence `preempt` left preempted under its id; the tokens it need not prefill
        (cached or loaded), or None when it does not fit now."""
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


class PreemptRecompute(Policy):
    name = "preempt by recompute, prefix cache"
    mode = "recompute"

    def __init__(self, reserve_fraction: float = RESERVE_FRACTION) -> None:
        self.reserve_fraction = reserve_fraction

    def make_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return KVCache(num_blocks, block_size, reserve_fraction=self.reserve_fraction)

    def admit(
        self, cache: KVCache, live: Live, context: np.ndarray, num_running: int, counters: Counters
    ) -> tuple[int, int] | None:
        max_new_tokens = len(live.request.output) - live.num_generated
        try:
            opened = cache.open(context, NAMESPACE, max_new_tokens=max_new_tokens)
        except NotAdmitted:
            return None
        live.seq_id = opened.seq_id
        return self.hits(opened)

    def hits(self, opened: OpenResult) -> tuple[int, int]:
        """(prompt tokens served from the device, from the host tier) of an admitted open."""
        return opened.num_cached_tokens, 0

    def victims(self, cache: KVCache, running: list[Live], num_blocks: int) -> list[Live]:
        """The core's order: lowest priority, then latest arrival, as few as give `num_blocks` back."""
        by_id = {live.seq_id: live for live in running}
        return [by_id[seq_id] for seq_id in cache.victims(num_blocks)]

    def preempt(self, cache: KVCache, live: Live, counters: Counters) -> None:
        cache.preempt([live.seq_id], "recompute")
        live.preempted = True

    def resume(self, cache: KVCache, live: Live, counters: Counters) -> int | None:
        try:
            resumed = cache.resume(live.seq_id)
        except OutOfBlocks:
            return None
        return resumed.num_cached_tokens


class PreemptSwap(PreemptRecompute):
    name = f"swap, host tier {HOST_FACTOR}x the pool"

    def __init__(self, reserve_fraction: float = RESERVE_FRACTION, host_factor: int = HOST_FACTOR) -> None:
        super().__init__(reserve_fraction)
        self.host_factor = host_factor

    def make_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return KVCache(
            num_blocks,
            block_size,
            reserve_fraction=self.reserve_fraction,
            host_num_blocks=self.host_factor * num_blocks,
        )

    def hits(self, opened: OpenResult) -> tuple[int, int]:
        return opened.num_cached_tokens - opened.num_host_hit_tokens, opened.num_host_hit_tokens

    def preempt(self, cache: KVCache, live: Live, counters: Counters) -> None:
        try:
            cache.preempt([live.seq_id], "swap")
        except OutOfBlocks:  # the host tier cannot take its blocks now
            cache.preempt([live.seq_id], "recompute")
        live.preempted = True
