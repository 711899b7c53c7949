"""Pins: cached prefixes kept resident however cold they get, counted per (namespace, whole-block prefix)."""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.errors import FailedPrecondition, LimitExceeded, NotPinned, OutOfBlocks
from radixkv.tree.radix_tree import Match, Node, RadixTree, TokenKey


class Pins:
    """Each pin locks its prefix's tree path and counts it as pinned; `unpin` with the same tokens undoes one.

    Pins of the same tokens are kept one by one, each with the node it locked: a repeat may lock a deeper
    node than the first did (more of the prefix cached since), so they cannot share one (node, count).
    """

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self._pins: dict[tuple[str, bytes], list[Node]] = {}  # the node each pin locked, latest last

    def pin(self, root: Node | None, key: TokenKey, namespace: str, max_pinned_blocks: int, num_unreserved: int) -> int:
        """Pin the cached prefix of `key` under `root` (None: an unknown namespace); returns tokens pinned.

        The cached blocks it newly locks stop being evictable, so they must fit in `num_unreserved`
        (what admission's reservations leave), else OutOfBlocks.
        """
        tree = self.tree
        match = tree.match(root, key.data) if root is not None else None
        if match is None or match.num_blocks == 0:
            raise FailedPrecondition(
                "nothing of this prefix is cached: open and release it with cache=True first", namespace=namespace
            )
        added = _blocks_to_pin(match)
        if tree.num_pinned_blocks + added > max_pinned_blocks:
            raise LimitExceeded("pinned_blocks", tree.num_pinned_blocks + added, max_pinned_blocks)
        newly_locked = match.num_newly_locked()
        if newly_locked > num_unreserved:
            raise OutOfBlocks(newly_locked, num_unreserved)
        node = tree.split(match)
        pin_key = (namespace, key.whole_block_prefix(tree.block_size))
        self._pins.setdefault(pin_key, []).append(node)
        tree.lock(node)
        tree.add_pin(node, +1)
        return match.num_blocks * tree.block_size

    def unpin(self, key: TokenKey, namespace: str) -> None:
        pin_key = (namespace, key.whole_block_prefix(self.tree.block_size))
        nodes = self._pins.get(pin_key)
        if not nodes:
            raise NotPinned(namespace)
        node = nodes.pop()
        if not nodes:
            del self._pins[pin_key]
        self.tree.add_pin(node, -1)
        self.tree.unlock(node)

    def holders(self) -> Iterable[tuple[Node, int]]:
        """Each pinned path's deepest node and how many pins hold it (for the invariant recount)."""
        return [(node, 1) for nodes in self._pins.values() for node in nodes]


def _blocks_to_pin(match: Match) -> int:
    """How many blocks pinning this match's path would add to the pinned count."""
    path = match.path
    blocks = sum(len(n.block_ids) for n in path[:-1] if n.pin_ref == 0)
    if path and path[-1].pin_ref == 0:
        blocks += match.num_blocks_in_node
    return blocks
