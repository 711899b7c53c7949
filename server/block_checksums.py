"""Writers' checksums of the K/V bytes of tree blocks, by block id: what a reader that copies blocks out verifies.

A checksum is the writer's claim about a block's bytes (the vLLM connector's saver computes it over
the bytes it wrote, `radixkv.vllm`). It is only recorded for blocks the prefix tree holds, whose bytes
never change while they stay there (the tree holds each block alone and no sequence writes a cached
block), and only the first claim is kept; a block that leaves the tree (evicted) forgets it, so a
recycled block id never carries an old checksum. The table survives an upgrade in the pool's snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument


class BlockChecksums:
    """One uint64 per block of a pool; 0 means none recorded. Used under the pool's lock."""

    def __init__(self, num_blocks: int) -> None:
        self.values = np.zeros(num_blocks, dtype=np.uint64)

    def record(self, block_ids: Sequence[int], checksums: Sequence[int]) -> int:
        """Record `checksums[i]` for `block_ids[i]` where none is yet; returns how many were recorded."""
        ids = np.asarray(block_ids, dtype=np.int64)
        new = np.asarray(checksums, dtype=np.uint64)
        empty = self.values[ids] == 0
        self.values[ids[empty]] = new[empty]
        return int(empty.sum())

    def get(self, block_ids: Sequence[int]) -> list[int]:
        return [int(v) for v in self.values[np.asarray(block_ids, dtype=np.int64)]]

    def forget(self, block_ids: npt.NDArray[np.int32]) -> None:
        """These blocks left the tree: their bytes are no longer anyone's claim."""
        self.values[block_ids] = 0

    def to_pairs(self) -> list[list[int]]:
        """[[block_id, checksum], ...] of every recorded block (for the snapshot)."""
        ids = np.flatnonzero(self.values)
        return [[int(b), int(self.values[b])] for b in ids]

    def restore(self, pairs: Sequence[Sequence[int]], tree_block_ids: set[int]) -> None:
        """Take a snapshot's pairs back, keeping only blocks the adopted tree holds."""
        self.values[:] = 0
        for block_id, checksum in pairs:
            if int(block_id) in tree_block_ids and 0 <= int(block_id) < len(self.values):
                self.values[int(block_id)] = int(checksum)


def table_range(table: Sequence[int], first_block: int, num_blocks: int, field: str) -> list[int]:
    """Blocks [first_block, first_block + num_blocks) of a block table, or InvalidArgument naming `field`."""
    if first_block < 0 or num_blocks < 0 or first_block + num_blocks > len(table):
        raise InvalidArgument(
            field, f"blocks [{first_block}, {first_block + num_blocks}) are not within the sequence's {len(table)}"
        )
    return list(table[first_block : first_block + num_blocks])
