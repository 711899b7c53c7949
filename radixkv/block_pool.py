"""Block bookkeeping over plain ints: reference counts and a free list. No memory, no tensors."""

from __future__ import annotations

from radixkv.errors import OutOfBlocks


class BlockPool:
    """`num_blocks` blocks, each with a `ref_count`: its holders that hold it by count.

    Those are the radix tree (one hold per cached block, exactly) and live sequences for the blocks
    of their tables that the tree does not hold for them. A sequence holds the cached prefix of its
    table through a path lock on the tree instead (`RadixTree.lock`: one walk of the path's nodes,
    however many blocks), so a cached block shared by many live sequences still has ref_count 1 and
    is reclaimable exactly when no lock covers it.

    Invariant: a block is on the free list exactly when its ref_count is 0, and at most once;
    free + used == num_blocks. Eviction is not the pool's business: the cache evicts before it
    allocates.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # Popped from the end; reversed so block 0 is handed out first (readable tables in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks with ref_count 1 each; all or nothing."""
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        if n <= 0:
            return []
        taken = self._free[: -n - 1 : -1]
        del self._free[-n:]
        ref_counts = self.ref_counts
        for block_id in taken:
            ref_counts[block_id] = 1
        return taken

    def incref(self, block_ids: list[int], by: int = 1) -> None:
        """Add `by` holds to each of `block_ids` (all currently held)."""
        ref_counts = self.ref_counts
        for block_id in block_ids:
            assert ref_counts[block_id] > 0, f"incref of free block {block_id}: caller holds a stale id"
            ref_counts[block_id] += by

    def decref(self, block_ids: list[int]) -> None:
        """Drop one hold on each of `block_ids`; blocks that reach 0 return to the free list."""
        ref_counts = self.ref_counts
        free = self._free
        for block_id in block_ids:
            count = ref_counts[block_id] - 1
            assert count >= 0, f"decref of free block {block_id}: double release by the caller"
            ref_counts[block_id] = count
            if count == 0:
                free.append(block_id)

    def free_exclusive(self, block_ids: list[int]) -> None:
        """Return blocks whose only holder lets go (evicted tree blocks) without counting down."""
        ref_counts = self.ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 0  # check_invariants verifies the caller's claim (tree blocks have count 1)
        self._free.extend(block_ids)

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def check_invariants(self) -> None:
        free = self._free
        assert len(set(free)) == len(free), "free list holds a block twice"
        assert not any(self.ref_counts[b] for b in free), "a block on the free list has a holder"
        assert min(self.ref_counts) >= 0, "negative ref_count"
        num_used = sum(1 for count in self.ref_counts if count)
        assert num_used + len(free) == self.num_blocks, f"free {len(free)} + used {num_used} != {self.num_blocks}"
