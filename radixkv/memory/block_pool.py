"""Block bookkeeping as int32 arrays: reference counts and a free stack. No memory, no tensors.

Every operation is a slice or a fancy-indexed update: allocating n blocks costs the same few
microseconds for 1 block or 8,000 (a 128k-token prompt at block 16), with no Python loop per block.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixkv.errors import OutOfBlocks

BlockIds = npt.NDArray[np.int32] | list[int]  # ids the pool takes back: arrays on hot paths, lists from tests
NO_BLOCKS: npt.NDArray[np.int32] = np.empty(0, dtype=np.int32)
NO_BLOCKS.flags.writeable = False
# The one small-batch threshold of the core: up to this many items (block ids, blocks, sequences), a call goes one
# by one in Python, past it in numpy (a numpy call costs about 8 Python steps). Every site that chooses reads this;
# tests/core/test_small_batch.py runs each on both sides.
SMALL_BATCH = 8


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: how many blocks of `denominator` tokens hold `numerator` tokens."""
    return -(-numerator // denominator)


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
        if num_blocks < 0:  # 0: an empty pool every allocation finds full (a host tier of none)
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > np.iinfo(np.int32).max:
            raise ValueError(f"num_blocks must fit in int32, got {num_blocks}")
        self.num_blocks = num_blocks
        # 4 bytes per block each: an empty pool of 1M blocks costs 8 MB, whatever it caches later.
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        # A stack: _free[:_num_free] are the free blocks, popped from the top. It starts reversed so
        # block 0 is handed out first (readable tables in tests).
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> npt.NDArray[np.int32]:
        """Take `n` free blocks with ref_count 1 each (a new int32 array); all or nothing."""
        if n > self._num_free:
            raise OutOfBlocks(n, self._num_free)
        if n <= 0:
            return NO_BLOCKS
        top = self._num_free
        taken = self._free[top - n : top][::-1].copy()  # a copy: later frees overwrite the stack
        self._num_free = top - n
        self.ref_counts[taken] = 1
        return taken

    def incref(self, block_ids: BlockIds, by: int = 1) -> None:
        """Add `by` holds to each of `block_ids` (distinct, all currently held: a fork's, whose parent holds them;
        `check_invariants` recounts every hold)."""
        if len(block_ids) <= SMALL_BATCH:  # a fork's partial last block, say
            ref_counts = self.ref_counts
            for block_id in block_ids.tolist() if isinstance(block_ids, np.ndarray) else block_ids:
                ref_counts[block_id] += by
            return
        self.ref_counts[_as_ids(block_ids)] += by

    def decref(self, block_ids: BlockIds) -> None:
        """Drop one hold on each of `block_ids` (distinct); blocks that reach 0 return to the free list.

        A block released twice goes below 0 and is never freed: `check_invariants` names it.
        """
        n = len(block_ids)
        if n <= SMALL_BATCH:  # a request's partial last block, say: Python ints cost less than numpy's calls
            if n:
                self._decref_each(block_ids.tolist() if isinstance(block_ids, np.ndarray) else block_ids)
            return
        ids = _as_ids(block_ids)
        counts = self.ref_counts[ids]
        counts -= 1
        self.ref_counts[ids] = counts
        if not counts.all():  # some reached 0 (a fork sibling's release often frees none)
            self._push(ids[counts == 0])

    def _decref_each(self, block_ids: list[int]) -> None:
        ref_counts = self.ref_counts
        for block_id in block_ids:
            count = ref_counts.item(block_id) - 1
            ref_counts[block_id] = count
            if not count:
                self._free[self._num_free] = block_id
                self._num_free += 1

    def drop_copied(self, block_ids: list[int]) -> None:
        """Drop the hold of each sequence that copied one of `block_ids` away before writing (copy-on-write; a
        block repeats once per copy). Another holder keeps each, so none is freed."""
        ref_counts = self.ref_counts
        if len(block_ids) <= SMALL_BATCH:
            for block_id in block_ids:
                ref_counts[block_id] -= 1
        else:
            np.subtract.at(ref_counts, block_ids, 1)
        assert all(ref_counts.item(b) > 0 for b in block_ids), "a copied block lost its last holder: the plan erred"

    def free_exclusive(self, block_ids: BlockIds) -> None:
        """Return blocks whose only holder lets go (evicted tree blocks) without counting down."""
        ids = _as_ids(block_ids)
        self.ref_counts[ids] = 0  # check_invariants verifies the caller's claim (tree blocks have count 1)
        self._push(ids)

    def _push(self, ids: np.ndarray) -> None:
        top = self._num_free
        self._free[top : top + ids.size] = ids
        self._num_free = top + ids.size

    def copy(self) -> BlockPool:
        """An independent copy of the counts and the free list (two array copies: the online audit's image)."""
        image = BlockPool.__new__(BlockPool)
        image.num_blocks, image._num_free = self.num_blocks, self._num_free
        image.ref_counts, image._free = self.ref_counts.copy(), self._free.copy()
        return image

    def free_block_ids(self) -> list[int]:
        block_ids: list[int] = self._free[: self._num_free].tolist()
        return block_ids

    def check_invariants(self) -> None:
        assert not (self.ref_counts < 0).any(), "negative ref_count: a block released more often than held"
        free = self._free[: self._num_free]
        assert np.unique(free).size == free.size, "free list holds a block twice"
        assert not self.ref_counts[free].any(), "a block on the free list has a holder"
        num_used = int(np.count_nonzero(self.ref_counts))
        assert num_used + free.size == self.num_blocks, f"free {free.size} + used {num_used} != {self.num_blocks}"


def _as_ids(block_ids: BlockIds) -> npt.NDArray[np.intp]:
    """Block ids as an intp array for fancy indexing: numpy indexes with intp without a cast, which on a few
    dozen int32 ids costs more than the cast itself (bench_core's fork and release)."""
    return np.asarray(block_ids, dtype=np.intp)
