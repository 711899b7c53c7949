"""How nodes leave the radix tree's device tier and rejoin it: the LRU list of unlocked leaves, eviction, unlinking a
leaf (gone, or moved among its parent's host-only children) and attaching a loaded-back host node.

A mixin of `RadixTree` (its state and invariants are documented there): eviction is a policy over the tree's
bookkeeping, kept apart from matching, insertion and locks so each reads on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList

from radixkv.memory.block_pool import NO_BLOCKS
from radixkv.tree.radix_node import Node, TreeObserver

if TYPE_CHECKING:
    from radixkv.tree.host_tier import HostTier


class TreeEviction:
    """The eviction half of `RadixTree`: every write to `_evictable_leaves` outside `insert`, `lock` and `unlock`."""

    block_bytes: int
    roots: dict[str, Node]
    observer: TreeObserver | None
    host: HostTier | None
    touched: set[Node] | None
    _evictable_leaves: SortedList
    num_evictable_blocks: int
    num_cached_blocks: int
    num_cached_blocks_in: dict[str, int]

    def _drop_if_empty(self, root: Node) -> None:
        """Forget a namespace with nothing cached and no holder, so namespaces cannot pile up."""
        if root.lock_ref == 0 and not root.children and not root.host_children:
            if self.roots.get(root.namespace) is root:
                del self.roots[root.namespace]

    def unlist_leaf(self, leaf: Node) -> None:
        """An evictable leaf leaves the LRU list (the host tier is evicting it)."""
        self._evictable_leaves.remove(leaf)

    def attach_loaded(self, node: Node) -> None:
        """A host-only node whose `block_ids` were just set (loaded back) joins its parent's device children,
        cached and evictable until the caller locks it; reported stored, as the device tier caches it again."""
        parent = node.parent
        assert parent is not None and len(node.block_ids) == len(node.host_block_ids), "load a whole host node"
        first = node.token_bytes[: self.block_bytes]
        del parent.host_children[first]
        if self.touched is not None:
            self.touched.update((node, parent))
        if parent.lock_ref == 0 and not parent.children and not parent.is_root:
            self._evictable_leaves.discard(parent)
        parent.children[first] = node
        self._evictable_leaves.add(node)
        n = len(node.block_ids)
        self.num_evictable_blocks += n
        self.num_cached_blocks += n
        self.num_cached_blocks_in[node.namespace] = self.num_cached_blocks_in.get(node.namespace, 0) + n
        if self.observer is not None:
            self.observer.blocks_stored(node)

    def drop_empty_roots(self) -> None:
        """After a refused request: forget namespaces it created and left empty."""
        for root in list(self.roots.values()):
            self._drop_if_empty(root)

    # -- eviction ---------------------------------------------------------------------------------

    def evict(self, num_blocks: int, namespaces: Callable[[str], bool] | None = None) -> npt.NDArray[np.int32]:
        """Drop at least `num_blocks` cached blocks (fewer if not that many are evictable), LRU first.

        A leaf larger than what is still needed loses only its tail blocks (a slice): the cost is
        O(log n) per leaf touched, and no more of the cache is dropped than asked for. With
        `namespaces`, only leaves of the namespaces it accepts are dropped (a tenant over its cache
        share); finding each costs a scan of the older leaves of other namespaces.
        """
        freed: list[npt.NDArray[np.int32]] = []
        num_freed = 0
        removed: dict[str, list[npt.NDArray[np.int32]]] = {}  # one report per namespace per call
        leaves = self._evictable_leaves
        while num_freed < num_blocks and leaves:
            leaf = leaves[0] if namespaces is None else next((n for n in leaves if namespaces(n.namespace)), None)
            if leaf is None:
                break
            need = num_blocks - num_freed
            if self.touched is not None:
                self.touched.add(leaf)
            if self.host is not None:
                dropped = self.host.evict_leaf(leaf, need)
            elif len(leaf.block_ids) > need:
                keep = len(leaf.block_ids) - need
                dropped, leaf.block_ids = leaf.block_ids[keep:], leaf.block_ids[:keep]
                leaf.token_bytes = leaf.token_bytes[: keep * self.block_bytes]
            else:
                dropped = leaf.block_ids
                leaves.remove(leaf)
                self._detach(leaf)
            freed.append(dropped)
            num_freed += len(dropped)
            removed.setdefault(leaf.namespace, []).append(dropped)
        for namespace, runs in removed.items():
            block_ids = runs[0] if len(runs) == 1 else np.concatenate(runs)
            left = self.num_cached_blocks_in[namespace] - len(block_ids)
            if left:
                self.num_cached_blocks_in[namespace] = left
            else:
                del self.num_cached_blocks_in[namespace]
            if self.observer is not None:
                self.observer.blocks_removed(namespace, block_ids)
        self.num_evictable_blocks -= num_freed
        self.num_cached_blocks -= num_freed
        if len(freed) == 1:  # the usual case: one leaf trimmed
            return freed[0]
        return np.concatenate(freed) if freed else NO_BLOCKS

    def _detach(self, leaf: Node) -> None:
        self.unlink(leaf, to_host=False)

    def unlink(self, leaf: Node, to_host: bool) -> None:
        """Take an evicted leaf off the device tier: gone, or (`to_host`) moved among its parent's host children.
        Its parent may become an evictable leaf."""
        parent = leaf.parent
        assert parent is not None
        first = leaf.token_bytes[: self.block_bytes]
        del parent.children[first]
        if self.touched is not None:
            self.touched.add(parent)
        if to_host:
            parent.host_children[first] = leaf
        else:
            leaf.parent = None
        if not parent.children and parent.lock_ref == 0:
            if parent.parent is None:
                self._drop_if_empty(parent)
            else:
                self._evictable_leaves.add(parent)

    def evictable_leaves(self) -> list[Node]:
        return list(self._evictable_leaves)

    def is_listed_evictable(self, node: Node) -> bool:
        """Is `node` on the evictable list, found under its current LRU key? (O(log n), for the audit.)"""
        return node in self._evictable_leaves

    @property
    def num_listed_evictable(self) -> int:
        return len(self._evictable_leaves)
