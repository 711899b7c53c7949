"""Questions a scheduler asks before acting: what releasing a set of sequences would give back, and whom to preempt."""

from __future__ import annotations

import collections

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument
from radixkv.sequences.sequence import LiveSequence
from radixkv.tree.lock_counts import Unlocks


def freeable_blocks(ref_counts: npt.NDArray[np.int32], sequences: list[LiveSequence]) -> int:
    """Blocks that become free or evictable once `sequences` are released together.

    The same for `cache=True` and `cache=False`: a block the release caches becomes evictable and
    one it does not cache becomes free, and both count as available. What the sequences share with
    others is counted only where they are its last holders: a block held by count where they hold
    every count of it, a locked node's blocks where they hold every lock on it.
    """
    unlocks = Unlocks()
    unlocked = sum(unlocks.let_go(seq.lock_node) for seq in sequences)
    held = np.concatenate([np.empty(0, np.int32), *(seq.private_blocks() for seq in sequences)])
    block_ids, holds = np.unique(held, return_counts=True)
    freed = int(np.count_nonzero(ref_counts[block_ids] == holds))
    return freed + unlocked


def victims(ref_counts: npt.NDArray[np.int32], sequences: list[LiveSequence], num_blocks: int) -> list[int]:
    """Whom to preempt (or release) to give `num_blocks` back to allocation, in the order to do it.

    Candidates go lowest `priority` first, then latest arrival first (the highest seq id; a resumed
    sequence keeps its id, so its arrival), as vLLM picks its victims. The list is the shortest
    prefix of that order whose sequences together give back at least `num_blocks`: the blocks
    `freeable_blocks` counts for them plus their reservations (which return too). When even every
    sequence together gives back less, every sequence is listed.
    """
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
        raise InvalidArgument("num_blocks", f"must be a non-negative integer, got {num_blocks!r}")
    order = sorted(sequences, key=lambda seq: (seq.priority, -seq.seq_id))
    holds: collections.Counter[int] = collections.Counter()
    unlocks = Unlocks()
    chosen: list[int] = []
    given = 0
    for seq in order:
        if given >= num_blocks:
            break
        chosen.append(seq.seq_id)
        given += seq.reservation()
        for block_id in seq.private_blocks().tolist():
            holds[block_id] += 1
            if holds[block_id] == ref_counts[block_id]:  # every holder of it is chosen now
                given += 1
        given += unlocks.let_go(seq.lock_node)
    return chosen
