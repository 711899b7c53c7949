"""Publishing a sequence's computed full blocks to the tree, so later requests hit them, and ending it."""

from __future__ import annotations

import numpy as np

from radixkv.memory.block_pool import BlockPool
from radixkv.sequences.sequence import LiveSequence
from radixkv.tree.radix_tree import RadixTree
from radixkv.tree.token_ids import TokenKey


def publish(tree: RadixTree, pool: BlockPool, seq: LiveSequence) -> None:
    """Insert the full blocks below the computed watermark and move `seq`'s lock down to them.

    Stops at a block another sequence of the fork family still holds by count (the tree's blocks
    have exactly one holder).
    """
    bs = tree.block_size
    num_full = min(seq.num_tokens, seq.num_computed_tokens) // bs
    if num_full <= seq.num_tree_blocks:
        return
    bb = TokenKey.num_bytes(bs)
    children = seq.lock_node.children
    if pool.ref_counts[seq.block_table.at(seq.num_tree_blocks)] > 1 and (not children or seq.tail(bs) not in children):
        return  # a fork sibling holds the first of them too, and the tree has no copy: nothing to publish yet
    new_blocks = seq.block_table[seq.num_tree_blocks : num_full]
    counts = pool.ref_counts[new_blocks]
    key = seq.tail(len(new_blocks) * bs)
    if counts.max() > 1:
        num_known = tree.match(seq.lock_node, key).num_blocks  # the tree keeps its own blocks for these
        held_by_others = np.flatnonzero(counts[num_known:] > 1)
        shared = num_known + int(held_by_others[0]) if held_by_others.size else len(new_blocks)
        if shared == 0:
            return
        new_blocks, key = new_blocks[:shared], key[: shared * bb]
        num_full = seq.num_tree_blocks + shared
    node, num_taken = tree.insert(seq.lock_node, key, new_blocks)
    # The tree takes over this sequence's hold on the blocks it took (the lock now covers them);
    # where it already held the prefix, the sequence keeps its duplicates privately.
    if num_taken < len(new_blocks):
        seq.private_prefix = np.concatenate((seq.private_prefix, new_blocks[: len(new_blocks) - num_taken]))
    tree.lock(node)
    tree.unlock(seq.lock_node)
    seq.lock_node, seq.num_tree_blocks = node, num_full
    seq.trim_tail(TokenKey.count(key))


def release(tree: RadixTree, pool: BlockPool, seq: LiveSequence, cache: bool) -> None:
    """Drop every hold `seq` has (its lock and its counted blocks), publishing first with `cache`."""
    if cache:
        publish(tree, pool, seq)
    tree.unlock(seq.lock_node)
    pool.decref(seq.private_blocks())
