"""Forking a sequence into children that share every block (parallel samples, beams).

The parent's computed full blocks enter the tree first (fork after committing the parent's K/V, as
samplers do), so the family shares them through the locked path. Any other block the family shares
is held by count: full blocks not yet computed (no one appends into a full block; once every holder
has computed one, the family publishes it together, see `radixkv.sequences.publish`) and the partial
last block, which no one writes while it is shared (a write copies it). Children inherit the parent's
computed watermark, and join its family (`LiveSequence.family`).
"""

from __future__ import annotations

from radixkv.errors import InvalidArgument, LimitExceeded
from radixkv.memory.block_pool import BlockPool
from radixkv.sequences.publish import publish
from radixkv.sequences.sequence import LiveSequence, Sequences
from radixkv.tree.radix_tree import RadixTree


def check_fork(sequences: Sequences, seq_id: int, num_children: int, max_children: int) -> LiveSequence:
    """The sequence to fork, or the error `fork` would raise."""
    seq = sequences.get(seq_id)
    if not isinstance(num_children, int) or isinstance(num_children, bool) or num_children < 1:
        raise InvalidArgument("num_children", f"must be a positive integer, got {num_children!r}")
    if num_children > max_children:
        raise LimitExceeded("max_fork_children", num_children, max_children)
    return seq


def fork(tree: RadixTree, pool: BlockPool, sequences: Sequences, seq: LiveSequence, num_children: int) -> list[int]:
    """Publish `seq`'s computed blocks, then add `num_children` holders of everything it holds; returns their ids."""
    publish(tree, pool, seq)
    pool.incref(seq.private_blocks(), by=num_children)
    tree.lock(seq.lock_node, num_children)
    return [sequences.fork(seq).seq_id for _ in range(num_children)]
