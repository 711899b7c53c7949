"""Questions a scheduler asks before acting: what releasing a set of sequences would give back."""

from __future__ import annotations

import collections

import numpy as np
import numpy.typing as npt

from radixkv.radix_node import Node
from radixkv.sequence import LiveSequence


def freeable_blocks(ref_counts: npt.NDArray[np.int32], sequences: list[LiveSequence]) -> int:
    """Blocks that become free or evictable once `sequences` are released together.

    The same for `cache=True` and `cache=False`: a block the release caches becomes evictable and
    one it does not cache becomes free, and both count as available. What the sequences share with
    others is counted only where they are its last holders: a block held by count where they hold
    every count of it, a locked node's blocks where they hold every lock on it.
    """
    locks: collections.Counter[int] = collections.Counter()
    nodes: dict[int, Node] = {}
    for seq in sequences:
        node = seq.lock_node
        while node.parent is not None:
            locks[node.node_id] += 1
            nodes[node.node_id] = node
            node = node.parent
    held = np.concatenate([np.empty(0, np.int32), *(seq.private_blocks() for seq in sequences)])
    block_ids, holds = np.unique(held, return_counts=True)
    freed = int(np.count_nonzero(ref_counts[block_ids] == holds))
    unlocked = sum(len(nodes[i].block_ids) for i, n in locks.items() if nodes[i].lock_ref == n)
    return freed + unlocked
