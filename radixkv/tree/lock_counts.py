"""The tree's locks recounted from their holders, and what letting some holders go would unlock.

A node's `lock_ref` counts its own holders (live sequences and pins whose locked node it is) and its locked
children (`RadixTree.lock`), so locking walks only the nodes it newly locks. What needs the counts from scratch
(the invariant check, a snapshot, preemption's arithmetic) reads them here; none of it is a hot path.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from radixkv.tree.radix_tree import Node


def lock_refs(roots: Iterable[Node], holders: Iterable[tuple[Node, int]]) -> dict[int, int]:
    """What every node's lock_ref should be (roots included), by node id: its holders in `holders` (node, count)
    plus its children whose own count is nonzero. Children first, without recursion (a beam search's path runs
    thousands of nodes deep)."""
    own: collections.Counter[int] = collections.Counter()
    for node, count in holders:
        own[node.node_id] += count
    expected: dict[int, int] = {}
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                locked = sum(1 for child in node.children.values() if expected[child.node_id])
                expected[node.node_id] = own[node.node_id] + locked
            else:
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())
    return expected


def holders_through(holders: Iterable[tuple[Node, int]]) -> collections.Counter[int]:
    """How many of `holders` lock a path through each node, by node id (roots included): a snapshot's form of the
    counts, which needs no walk order to check."""
    counts: collections.Counter[int] = collections.Counter()
    for node, count in holders:
        walk: Node | None = node
        while walk is not None:
            counts[walk.node_id] += count
            walk = walk.parent
    return counts


class Unlocks:
    """The nodes that letting some holders go would unlock, added up one holder at a time: a node unlocks once the
    holders let go of it and its children that unlock make up its whole lock_ref, and then counts once for its
    parent. Changes nothing in the tree."""

    def __init__(self) -> None:
        self._gone: collections.Counter[int] = collections.Counter()

    def let_go(self, node: Node, count: int = 1) -> int:
        """Let `count` holders of `node` go; returns the blocks of the nodes that unlock with them."""
        blocks = 0
        while node.parent is not None:
            gone = self._gone[node.node_id] + count
            self._gone[node.node_id] = gone
            if gone != node.lock_ref:
                return blocks
            blocks += len(node.block_ids)
            node, count = node.parent, 1
        return blocks
