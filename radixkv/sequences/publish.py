"""Publishing a sequence's computed full blocks to the tree, so later requests hit them, and ending it."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixkv.memory.block_pool import SMALL_BATCH, BlockPool
from radixkv.sequences.sequence import LiveSequence
from radixkv.tree.radix_tree import RadixTree, TokenKey


def publish(tree: RadixTree, pool: BlockPool, seq: LiveSequence) -> None:
    """Insert the full blocks below the computed watermark and move `seq`'s lock down to them.

    A block that other sequences also hold by count enters the tree only with all of them: members of `seq`'s
    fork family at the same place in the tree that have computed it too move their holds to the tree with it
    (the tree's blocks have exactly one holder). Publishing stops at the first block held by anyone else.
    """
    bs = tree.block_size
    num_full = min(seq.num_tokens, seq.num_computed_tokens) // bs
    if num_full <= seq.num_tree_blocks:
        return
    bb = TokenKey.num_bytes(bs)
    new_blocks = seq.block_table[seq.num_tree_blocks : num_full]
    counts = _shared_holds(pool, new_blocks)
    key = seq.tail(len(new_blocks) * bs)
    kin: list[tuple[LiveSequence, int]] = []  # family members that take the tree's hold on their first k blocks
    if counts is not None:
        num_known = tree.match(seq.lock_node, key).num_blocks  # the tree keeps its own blocks for these
        if num_known:
            shared = next((i for i in range(num_known, len(counts)) if counts[i] > 1), len(counts))
        else:
            shared, kin = _with_family(seq, new_blocks, counts, bs)
        if shared == 0:
            return
        new_blocks, key = new_blocks[:shared], key[: shared * bb]
        num_full = seq.num_tree_blocks + shared
    node, num_taken = tree.insert(seq.lock_node, key, new_blocks)  # locked for seq
    # The tree takes over this sequence's hold on the blocks it took (the lock now covers them);
    # where it already held the prefix, the sequence keeps its duplicates privately.
    if num_taken < len(new_blocks):
        seq.private_prefix = np.concatenate((seq.private_prefix, new_blocks[: len(new_blocks) - num_taken]))
    start = seq.lock_node
    tree.unlock(start)  # `insert` locked `node`: both walked only the nodes below `start` (see `RadixTree.lock`)
    seq.lock_node, seq.num_tree_blocks = node, num_full
    for member, k in kin:  # the same blocks, so the tree knows them all: it splits the node where one stops
        member_node, _ = tree.insert(start, key[: k * bb], new_blocks[:k])  # locked for the member
        tree.unlock(start)
        member.lock_node, member.num_tree_blocks = member_node, member.num_tree_blocks + k
        member.trim_tail(k * bs)
        pool.decref(new_blocks[:k])  # the tree's hold remains
    seq.trim_tail(TokenKey.count(key))


def _shared_holds(pool: BlockPool, blocks: npt.NDArray[np.int32]) -> list[int] | None:
    """Each block's holders when any of them has more than one, else None. A few blocks (a decode step's fork
    publishes one) one by one: numpy's indexing and reduction cost a microsecond or more each."""
    ref_counts = pool.ref_counts
    if len(blocks) <= SMALL_BATCH:
        counts = [ref_counts.item(block) for block in blocks.tolist()]
        return counts if max(counts) > 1 else None
    held = ref_counts[blocks]
    return held.tolist() if held.max() > 1 else None


def _with_family(
    seq: LiveSequence, new_blocks: npt.NDArray[np.int32], counts: list[int], bs: int
) -> tuple[int, list[tuple[LiveSequence, int]]]:
    """How many of `new_blocks` (none cached) can enter the tree now, and the family members that give up their
    holds on the first k of them: those locking the same node whose table holds the same blocks there (so the
    same tokens: a full block is never written once shared), computed. Each block goes in only if those members
    are all its other holders."""
    kin = []
    if seq.family is not None:
        start, blocks = seq.num_tree_blocks, new_blocks.tolist()
        for member in seq.family.values():
            if member is seq or member.lock_node is not seq.lock_node:
                continue
            limit = min(len(blocks), member.num_computed_tokens // bs - start)
            theirs = member.block_table[start : start + limit].tolist() if limit > 0 else []
            k = 0
            while k < len(theirs) and theirs[k] == blocks[k]:
                k += 1
            if k:
                kin.append((member, k))
    shared = 0
    for held in counts:  # the holds past seq's own, block by block
        if held - 1 != sum(1 for _, k in kin if k > shared):
            break
        shared += 1
    return shared, [(member, min(k, shared)) for member, k in kin if min(k, shared)]


def release(tree: RadixTree, pool: BlockPool, seq: LiveSequence, cache: bool) -> None:
    """Drop every hold `seq` has (its lock and its counted blocks), publishing first with `cache`."""
    if cache:
        publish(tree, pool, seq)
    tree.unlock(seq.lock_node)
    pool.decref(seq.private_blocks())
