"""Pins: cached prefixes kept resident however cold they get, counted per (namespace, whole-block prefix)."""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.admission import num_newly_locked
from radixkv.errors import FailedPrecondition, LimitExceeded, NotPinned, OutOfBlocks
from radixkv.radix_tree import Node, RadixTree
from radixkv.token_ids import TokenKey


class Pins:
    """Each pin locks its prefix's tree path and counts it as pinned; `unpin` with the same tokens undoes one."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self._pins: dict[tuple[str, bytes], tuple[Node, int]] = {}

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
        added = tree.blocks_to_pin(match.path, match.num_blocks_in_node)
        if tree.num_pinned_blocks + added > max_pinned_blocks:
            raise LimitExceeded("pinned_blocks", tree.num_pinned_blocks + added, max_pinned_blocks)
        newly_locked = num_newly_locked(match)
        if newly_locked > num_unreserved:
            raise OutOfBlocks(newly_locked, num_unreserved)
        node = tree.split(match)
        pin_key = (namespace, key.whole_block_prefix(tree.block_size))
        _, count = self._pins.get(pin_key, (node, 0))
        self._pins[pin_key] = (node, count + 1)
        tree.lock(node)
        tree.add_pin(node, +1)
        return match.num_blocks * tree.block_size

    def unpin(self, key: TokenKey, namespace: str) -> None:
        pin_key = (namespace, key.whole_block_prefix(self.tree.block_size))
        if pin_key not in self._pins:
            raise NotPinned(namespace)
        node, count = self._pins.pop(pin_key)
        if count > 1:
            self._pins[pin_key] = (node, count - 1)
        self.tree.add_pin(node, -1)
        self.tree.unlock(node)

    def holders(self) -> Iterable[tuple[Node, int]]:
        """Each pinned path's deepest node and how many pins hold it (for the invariant recount)."""
        return self._pins.values()
