"""Retention hints on a cached prefix, and a TTL's expiry (`radixkv.tree.eviction` says what they mean)."""

from __future__ import annotations

from radixkv.sequences.admission import Allocator
from radixkv.tree.eviction import Retention, apply
from radixkv.tree.radix_tree import Node, TokenKey


def retain(blocks: Allocator, root: Node, key: TokenKey, retention: Retention) -> int:
    """Write `retention` on the cached prefix of `key` below `root` (split where the prefix ends inside a node);
    returns the tokens it covers. Listed leaves move to their new place in the eviction order."""
    tree = blocks.tree
    match = tree.match(root, key.data)
    if not match.num_blocks:
        return 0
    path = match.path
    path[-1] = tree.split(match)
    if tree.touched is not None:
        tree.touched.update(path)
    for node in apply(path, retention, tree.policy.clock()):
        tree.relist(node)
    return match.num_blocks * tree.block_size


def expire(blocks: Allocator) -> int:
    """Evict every unlocked prefix whose TTL ran out (and nothing else); returns the blocks freed."""
    evicted = blocks.tree.evict_expired(blocks.tree.policy.clock())
    blocks.stats.num_evicted_blocks += len(evicted)
    blocks.pool.free_exclusive(evicted)
    return len(evicted)
