"""The radix tree of token prefixes: which full blocks hold which prefix, per namespace.

A node holds a run of whole blocks: `token_bytes` (int32, `len(block_ids) * block_size` tokens) and
their `block_ids`. Children are keyed by the bytes of their first block, so a walk costs one dict
lookup and one memcmp per node, never a Python loop per token. The tree owns one hold (ref_count)
on each block it keeps; the caller (`KVCache`) turns the block ids the tree drops into decrefs.
Eviction and moves between the tiers live in `radixkv.tree.tree_eviction` (a mixin of `RadixTree`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList

from radixkv.memory.block_pool import NO_BLOCKS, BlockIds
from radixkv.state.invariants import check_tree
from radixkv.tree.radix_node import Match, Node, TreeObserver, lru_key
from radixkv.tree.token_ids import TOKEN_BYTES, common_blocks
from radixkv.tree.tree_eviction import TreeEviction

if TYPE_CHECKING:
    from radixkv.tree.host_tier import HostTier

__all__ = ["Match", "Node", "RadixTree", "TreeObserver", "lru_key"]


class RadixTree(TreeEviction):
    """Prefixes of full blocks, one root per namespace, with locks and LRU eviction of unlocked leaves.

    Invariants (checked by `check_invariants`): a node's lock_ref counts the locks at or below it;
    every unlocked childless non-root node is in `_evictable_leaves` (a SortedList by last access);
    `num_evictable_blocks` is the number of blocks in unlocked nodes; parents are accessed no earlier
    than their children, so evicting leaves in LRU order never skips an older block.

    The SortedList is keyed on `last_access`, which changes; it stays ordered because only `lock`
    and `unlock` write it, and never on a listed node: `lock` removes an unlocked leaf from the list
    before writing, `unlock` writes a node that is still locked and lists it (with the new key) only
    once its count reaches 0. A split gives the new upper node its child's key and leaves the listed
    child as it is; trimming a leaf's tail keeps its key. `check_invariants` verifies the order.

    `touched`, while not None (an online audit copying the tree over several lock holds), collects every
    non-root node whose fields or children change: every write to a device node goes through a method here
    (the host tier writes host-only nodes, which the audit does not copy, and moves nodes between the tiers
    only through `unlink` and `attach_loaded`).
    """

    def __init__(self, block_size: int, observer: TreeObserver | None = None) -> None:
        self.block_size = block_size
        self.observer = observer
        self.block_bytes = block_size * TOKEN_BYTES
        self.roots: dict[str, Node] = {}
        self._evictable_leaves: SortedList = SortedList(key=lru_key)
        self.num_evictable_blocks = 0
        self.num_pinned_blocks = 0
        self.num_cached_blocks = 0
        self.num_cached_blocks_in: dict[str, int] = {}  # per namespace with any cached block (tenant cache shares)
        self._clock = 0
        self.host: HostTier | None = None  # the host tier evictions move blocks to, if any (it sets this)
        self.touched: set[Node] | None = None  # see the class docstring; None: nobody is copying the tree

    def root(self, namespace: str) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Node(b"", NO_BLOCKS, None, namespace)
        return root

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- matching ---------------------------------------------------------------------------------

    def match(self, root: Node, key: bytes, max_blocks: int | None = None) -> Match:
        """Longest cached prefix of `key` in whole blocks (at most `max_blocks`); changes nothing."""
        block_bytes = self.block_bytes
        limit = len(key) // block_bytes if max_blocks is None else min(max_blocks, len(key) // block_bytes)
        end = limit * block_bytes
        node, pos, path = root, 0, []
        num_in_node = 0
        while pos < end:
            child = node.children.get(key[pos : pos + block_bytes])
            if child is None:
                break
            run = child.token_bytes
            path.append(child)
            if pos + len(run) <= end and key.startswith(run, pos):
                node, pos, num_in_node = child, pos + len(run), len(child.block_ids)
                continue
            num_in_node = common_blocks(key, pos, end, run, self.block_size)  # the match ends inside `child`
            node, pos = child, pos + num_in_node * block_bytes
            break
        return Match(node, num_in_node, pos // block_bytes, path)

    def split(self, match: Match) -> Node:
        """Make the match end on a node boundary; returns the node that ends exactly there."""
        node, k = match.node, match.num_blocks_in_node
        if node.is_root or k == len(node.block_ids):
            return node
        assert node.parent is not None and k > 0, "a match ends at least one block into a node"
        cut = k * self.block_bytes
        upper = Node(
            node.token_bytes[:cut],
            node.block_ids[:k],
            node.parent,
            node.namespace,
            {},
            node.lock_ref,
            node.pin_ref,
            node.last_access,
        )
        node.parent.children[node.token_bytes[: self.block_bytes]] = upper
        if self.touched is not None:
            self.touched.update((node, upper, node.parent))
        node.token_bytes, node.block_ids, node.parent = node.token_bytes[cut:], node.block_ids[k:], upper
        upper.children[node.token_bytes[: self.block_bytes]] = node
        if len(node.host_block_ids) and self.host is not None:  # a host copy splits with it
            upper.host_block_ids, node.host_block_ids = node.host_block_ids[:k], node.host_block_ids[k:]
            self.host.split_copy(node, upper)
        return upper

    # -- insertion --------------------------------------------------------------------------------

    def insert(self, start: Node, key: bytes, block_ids: BlockIds) -> tuple[Node, int]:
        """Add the full blocks of `key` (tokens below `start`) under `start`.

        Returns the deepest node now holding the prefix and how many of `block_ids` (always the
        last ones) the tree took; the caller then locks that node, which also refreshes the path's
        last access. Where the tree already holds a prefix it keeps its own blocks, and the
        caller's duplicates stay with the caller, freed once unused.
        """
        assert len(key) == len(block_ids) * self.block_bytes, "insert needs whole blocks"
        node, pos, i = start, 0, 0
        num_taken = 0
        now = self._clock
        while pos < len(key):
            match = self.match(node, key[pos:], None)
            if match.num_blocks:
                node = self.split(match)
                pos += match.num_blocks * self.block_bytes
                i += match.num_blocks
                continue
            new_ids = np.array(block_ids[i:], dtype=np.int32)  # the node's own copy (the caller's may change)
            if self.host is not None:
                self.host.drop_overlap(node, key[pos : pos + self.block_bytes])
            child = Node(key[pos:], new_ids, node, node.namespace, last_access=now)
            if node.lock_ref == 0 and not node.children and not node.is_root:
                self._evictable_leaves.discard(node)
            node.children[key[pos : pos + self.block_bytes]] = child
            if self.touched is not None:
                self.touched.update((node, child))
            self._evictable_leaves.add(child)
            self.num_evictable_blocks += len(new_ids)
            self.num_cached_blocks += len(new_ids)
            self.num_cached_blocks_in[node.namespace] = self.num_cached_blocks_in.get(node.namespace, 0) + len(new_ids)
            num_taken = len(new_ids)
            node = child
            if self.observer is not None:
                self.observer.blocks_stored(child)
            break
        return node, num_taken

    # -- locks ------------------------------------------------------------------------------------

    def lock(self, node: Node, count: int = 1) -> None:
        """Protect `node` and its ancestors from eviction (`count` holders at once).

        The root counts its namespace's holders too: a namespace lives while it holds a lock or a node.
        """
        now = self.tick()
        touched = self.touched
        while node.parent is not None:
            if touched is not None:
                touched.add(node)
            if node.lock_ref == 0:
                self.num_evictable_blocks -= len(node.block_ids)
                if not node.children:
                    self._evictable_leaves.remove(node)
            node.lock_ref += count
            node.last_access = now
            node = node.parent
        node.lock_ref += count

    def unlock(self, node: Node, count: int = 1) -> None:
        now = self.tick()
        touched = self.touched
        while node.parent is not None:
            if touched is not None:
                touched.add(node)
            node.lock_ref -= count
            assert node.lock_ref >= 0, "unlock without a matching lock"
            node.last_access = now
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.block_ids)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.parent
        node.lock_ref -= count
        self._drop_if_empty(node)

    def add_pin(self, node: Node, delta: int) -> None:
        """Count `node`'s path as pinned (delta +1) or not (-1); the caller also locks/unlocks it."""
        while node.parent is not None:
            if self.touched is not None:
                self.touched.add(node)
            before = node.pin_ref
            node.pin_ref += delta
            if (before == 0) != (node.pin_ref == 0):
                self.num_pinned_blocks += len(node.block_ids) if delta > 0 else -len(node.block_ids)
            node = node.parent

    def blocks_to_pin(self, path: list[Node], num_blocks_in_last: int) -> int:
        """How many blocks pinning this path would add to the pinned count."""
        blocks = sum(len(n.block_ids) for n in path[:-1] if n.pin_ref == 0)
        if path and path[-1].pin_ref == 0:
            blocks += num_blocks_in_last
        return blocks

    # -- inspection -------------------------------------------------------------------------------

    def nodes(self) -> Iterator[tuple[str, Node]]:
        """Every non-root node with its namespace, parents before children."""
        for namespace, root in self.roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield namespace, node
                stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Recount from scratch and compare (see `radixkv.state.invariants.check_tree`)."""
        check_tree(self)

    def tree_block_ids(self) -> npt.NDArray[np.int32]:
        """Every cached block, node by node (for invariant recounts)."""
        return np.concatenate([NO_BLOCKS, *(node.block_ids for _, node in self.nodes())])
