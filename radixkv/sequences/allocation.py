"""Taking blocks: from the free stack first, then by evicting unlocked cached blocks, LRU first.

Reservations (admission's reserved growth, see `radixkv.pressure.budget`) are a count here, not blocks: a
reserved block is any free or evictable one that no one else may take. So an allocation must fit in
what the reservations leave, except for the blocks it draws on its own sequence's reservation.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, OutOfBlocks
from radixkv.memory.block_pool import BlockPool
from radixkv.stats import Stats
from radixkv.tree.host_tier import HostTier
from radixkv.tree.radix_tree import RadixTree


class Allocator:
    """The pool and the tree's evictable blocks seen as one supply, with the counters they move.

    `num_reserved` is the sum of `LiveSequence.reservation()` over live sequences (the invariant checker
    recounts it). `host`: the host tier evictions offload to, whose transfers each result hands out.
    """

    def __init__(self, pool: BlockPool, tree: RadixTree, stats: Stats, host: HostTier | None = None) -> None:
        self.pool, self.tree, self.stats, self.host = pool, tree, stats, host
        self.num_reserved = 0

    def num_available(self) -> int:
        """Free now, or free after evicting every unlocked cached block."""
        return self.pool.num_free + self.tree.num_evictable_blocks

    def num_unreserved(self) -> int:
        """What an allocation not drawing on a reservation may take: available less every reservation."""
        return max(0, self.num_available() - self.num_reserved)

    def refuse_unless(self, needed: int, available: int) -> None:
        """Raise OutOfBlocks (and count the failure) when `needed` exceeds `available`."""
        if needed > available:
            self.stats.num_allocation_failures += 1
            raise OutOfBlocks(needed, available)

    def allocate(self, n: int, drawn: int = 0) -> npt.NDArray[np.int32]:
        """`n` blocks, evicting the shortfall first; all or none. `drawn` of them come out of the
        caller's reservations (which shrink by as much); the rest must fit in what is unreserved."""
        available = self.pool.num_free + self.tree.num_evictable_blocks
        self.refuse_unless(n - drawn, max(0, available - self.num_reserved))
        self.refuse_unless(n, available)
        self.num_reserved -= drawn
        shortfall = n - self.pool.num_free
        if shortfall > 0:
            self.evict(shortfall)
        return self.pool.allocate(n)

    def evict(self, num_blocks: int, owner: str | None = None) -> int:
        """Evict up to `num_blocks` (only from `owner`'s namespaces, if given: `owner_of`); returns how many."""
        evicted = self.tree.evict(num_blocks, owner)
        self.stats.num_evicted_blocks += len(evicted)
        self.pool.free_exclusive(evicted)  # the tree was their only holder
        return len(evicted)

    def evict_checked(self, num_blocks: int, owner: str | None = None) -> int:
        """`evict` for a caller's `num_blocks`: InvalidArgument unless a non-negative integer."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise InvalidArgument("num_blocks", f"must be a non-negative integer, got {num_blocks!r}")
        return self.evict(num_blocks, owner) if num_blocks else 0
