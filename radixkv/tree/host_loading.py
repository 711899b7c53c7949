"""Bringing host-tier prefixes back to the device: matching a key past the device tier into host-only nodes,
keeping a planned path from host eviction, and loading it into fresh device blocks.

A mixin of `HostTier` (its state and invariants are documented there), apart from the host allocator and its
LRU so the read path (match, plan, load) reads on its own; see `radixkv.tree.host_tier` for why loads are ordered
after offloads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList

from radixkv.memory.block_pool import NO_BLOCKS
from radixkv.memory.block_pairs import NO_PAIRS, Pairs, pairs_of
from radixkv.stats import Stats
from radixkv.tree.radix_node import Match, Node
from radixkv.tree.token_ids import common_blocks

if TYPE_CHECKING:
    from radixkv.tree.radix_tree import RadixTree

BlockIds = npt.NDArray[np.int32]  # host or device block ids, on the hot paths
HostPath = tuple[list[Node], int, int]  # host-only nodes top-down, blocks matched in the last one, in all


class HostLoading:
    """The loading half of `HostTier`: `match`, `plan_load`, `load_back`, `load` and the host-node split."""

    tree: RadixTree
    stats: Stats
    block_bytes: int
    _leaves: SortedList
    _fresh: dict[int, Node]
    _protected: dict[int, tuple[Node, int]]

    def match(self, match: Match, key: bytes, max_blocks: int) -> tuple[list[Node], int, int]:
        """Where the host tier continues a device match of `key` (at most `max_blocks` from the root).

        Returns the host-only nodes on the way (top-down), the blocks matched in the last one, and the blocks
        matched in all of them. Nothing when the device match ends inside a node. Changes nothing.
        """
        node, bb = match.node, self.block_bytes
        if node.parent is not None and match.num_blocks_in_node < len(node.block_ids):
            return [], 0, 0
        pos, end = match.num_blocks * bb, min(max_blocks, len(key) // bb) * bb
        path: list[Node] = []
        num_in_last = 0
        while pos < end:
            child = node.host_children.get(key[pos : pos + bb])
            if child is None:
                break
            run = child.token_bytes
            path.append(child)
            if pos + len(run) <= end and key.startswith(run, pos):
                node, pos, num_in_last = child, pos + len(run), len(child.host_block_ids)
                continue
            num_in_last = common_blocks(key, pos, end, run, self.tree.block_size)
            pos += num_in_last * bb
            break
        return path, num_in_last, pos // bb - match.num_blocks

    def plan_load(self, key: bytes, node: Node, num_matched: int, max_blocks: int) -> HostPath:
        """Where the host tier continues `key` past the locked device node `node` (a node boundary, `num_matched`
        blocks from the root), kept from host eviction until `load_back` (the open's own allocation, which may
        offload, must not evict what it is about to load)."""
        path, num_in_last, num_blocks = self.match(Match(node, len(node.block_ids), num_matched, []), key, max_blocks)
        if num_blocks:
            end = path[-1]
            self._leaves.discard(end)
            held = sum(len(n.host_block_ids) for n in path)
            self._protected[end.node_id] = (end, held)
        return path, num_in_last, num_blocks

    def load_back(self, node: Node, planned: HostPath, device_ids: BlockIds) -> tuple[Node, Pairs]:
        """Load the planned host path into the first of `device_ids` and move the lock from `node` down to the
        last loaded node; returns it and the load pairs."""
        path, num_in_last, num_blocks = planned
        if not num_blocks:
            return node, NO_PAIRS
        end = path[-1]
        del self._protected[end.node_id]
        last, pairs = self.load(path, num_in_last, device_ids[:num_blocks])
        if not len(end.block_ids) and not end.host_children:  # split: its host-only tail is a leaf again
            self._leaves.add(end)
        self.tree.lock(last)
        self.tree.unlock(node)
        return last, pairs

    def load(self, path: list[Node], num_in_last: int, device_ids: BlockIds) -> tuple[Node, Pairs]:
        """Bring the host path `path` (as `match` returned it) back to the device into `device_ids`.

        Each node becomes a device node keeping its host copy. Returns the deepest loaded node (the caller locks
        it) and the load pairs `(host_block, device_block)`.
        """
        if num_in_last < len(path[-1].host_block_ids):
            path[-1] = self._split(path[-1], num_in_last)
        pairs, pos = [], 0
        for node in path:
            n = len(node.host_block_ids)
            self._leaves.discard(node)
            node.block_ids = device_ids[pos : pos + n]
            pos += n
            pairs.append(pairs_of(node.host_block_ids, node.block_ids))
            self._fresh[node.node_id] = node
            self.tree.attach_loaded(node)
        assert pos == len(device_ids), "load: device blocks and host path disagree"
        self.stats.num_loaded_blocks += pos
        return path[-1], np.concatenate(pairs)

    def _split(self, node: Node, k: int) -> Node:
        """Split host-only `node` after its first `k` blocks; returns the new upper node (`node` keeps the tail)."""
        parent, bb = node.parent, self.block_bytes
        assert parent is not None and 0 < k < len(node.host_block_ids), "a host split cuts inside a host node"
        upper = Node(node.token_bytes[: k * bb], NO_BLOCKS, parent, node.namespace, last_access=node.last_access)
        upper.host_block_ids = node.host_block_ids[:k]
        parent.host_children[node.token_bytes[:bb]] = upper
        node.token_bytes, node.host_block_ids, node.parent = node.token_bytes[k * bb :], node.host_block_ids[k:], upper
        upper.host_children[node.token_bytes[:bb]] = node
        return upper
