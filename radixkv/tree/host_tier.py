"""The host tier: a second pool in host memory under the device pool, holding the prefixes the device evicts.

A radix node's blocks live on the device (`block_ids`), on the host (`host_block_ids`) or both (a node
loaded back keeps its host copy, so evicting it again moves nothing). A host-only node hangs off its
parent's `host_children`, never its `children`, and its own children are host-only: every device walk
(match, lock, LRU eviction, events, snapshots) sees the device tier exactly as without a host tier, and
only `match` and `load` here step into the host tier.

The core moves no data. Evicting a device leaf records an offload `(device_block, host_block)`; a hit
on a host node records a load `(host_block, device_block)`. The worker applies a result's offloads, then
its copy-on-write copies, then its loads, then runs its step. That order is safe because:
- offloads wait in `pending` until the next result that hands out device blocks carries them (every
  allocating call drains them), so a freed device block is read by its offload before that same result
  (or a later one) writes it through a copy, a load or a step;
- a load reads a host block that this result's offloads may have just written (a prefix offloaded and
  hit again), so loads come after offloads;
- no host block a load reads is overwritten by an offload of the same result: a copy made by a load is
  not evictable, and host blocks a resume frees are not reused, until `settle` ends the result.

"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList

from radixkv.memory.block_pairs import NO_PAIRS, Pairs, pairs_of
from radixkv.memory.block_pool import NO_BLOCKS, BlockPool
from radixkv.stats import Stats
from radixkv.tree.radix_tree import Match, Node, RadixTree, common_blocks, lru_key

BlockIds = npt.NDArray[np.int32]  # host or device block ids, on the hot paths
HostPath = tuple[list[Node], int, int]  # host-only nodes top-down, blocks matched in the last one, in all


class HostTier:
    """Host blocks (a free stack, ref_count 1 per holder: a tree node or a swapped sequence) and their LRU.

    Invariants (`radixkv.tree.tree_check.check_host_tier`): every held host block belongs to exactly one
    host-resident node or swapped sequence; `_leaves` lists exactly the host-only nodes without host children,
    in LRU order (their `last_access` never changes while on the host); `_copies` and `_fresh` list the device
    nodes keeping a host copy; `num_cached_blocks` counts the host blocks of tree nodes.
    """

    def __init__(self, num_blocks: int, tree: RadixTree, stats: Stats) -> None:
        self.pool = BlockPool(num_blocks)
        self.tree, self.stats = tree, stats
        self.block_bytes = tree.block_bytes
        self.enabled = num_blocks > 0  # False: a tier of none (vLLM's null block): finds, takes and swaps nothing
        if self.enabled:  # else the tree keeps its `DropEvicted` hook: what it evicts is dropped
            tree.host = self
        self._leaves: SortedList = SortedList(key=lru_key)  # host-only nodes without host children: evict LRU first
        self._copies: dict[int, Node] = {}  # node_id -> device node keeping a host copy; evicted first, oldest first
        # Nodes whose host blocks a load of the result being built reads: never evicted, and their blocks never
        # freed for reuse, until `settle` (a device copy then joins `_copies`, a host-only node the LRU).
        self._fresh: dict[int, Node] = {}
        self._protected: dict[int, tuple[Node, int]] = {}  # end of a path an open will load -> the path's blocks
        self._deferred: list[npt.NDArray[np.int32]] = []  # host blocks freed by the result being built
        self._pending: list[Pairs] = []  # offloads not yet handed to the worker, in order
        self.num_cached_blocks = 0  # host blocks held by tree nodes (host-only nodes and copies)
        self.num_swapped_blocks = 0  # host blocks held by swapped sequences (freed or deferred at resume)
        self.num_swapped_sequences = 0  # counted by whoever swaps sequences out and back

    def num_evictable(self) -> int:
        """Host blocks of the tree that eviction may free now (all but this result's fresh copies and the paths
        opens are about to load)."""
        fresh = sum(len(n.host_block_ids) for n in self._fresh.values())
        return self.num_cached_blocks - fresh - sum(n for _, n in self._protected.values())

    # -- the device tier evicts into this one ---------------------------------------------------------

    def evict_leaf(self, leaf: Node, need: int) -> npt.NDArray[np.int32]:
        """Take a device leaf's blocks off the device (only its tail when it holds more than `need`); returns them.

        A leaf with a host copy just drops its device blocks; otherwise its blocks are offloaded when the host
        tier has room (or makes it by evicting its own LRU), else dropped with its host-only subtree.
        """
        tree = self.tree
        has_copy = len(leaf.host_block_ids) > 0
        if len(leaf.block_ids) > need and not has_copy:
            tree.split(Match(leaf, len(leaf.block_ids) - need, 0, path=[]))  # `leaf` keeps the tail, and its LRU place
        tree.unlist_leaf(leaf)
        dropped = leaf.block_ids
        if has_copy:
            self._copies.pop(leaf.node_id, None)  # a fresh copy stays listed as fresh
        elif self._make_room(len(dropped)):
            leaf.host_block_ids = self.pool.allocate(len(dropped))
            self._pending.append(pairs_of(dropped, leaf.host_block_ids))
            self.num_cached_blocks += len(dropped)
            self.stats.num_offloaded_blocks += len(dropped)
        else:
            self._drop_subtree(leaf)
            tree.unlink(leaf, to_host=False)
            return dropped
        leaf.block_ids = NO_BLOCKS
        tree.unlink(leaf, to_host=True)
        if self._listable(leaf):
            self._leaves.add(leaf)
        return dropped

    def _listable(self, node: Node) -> bool:
        """Whether a host-only node belongs on the LRU list: a leaf, not protected, not fresh."""
        return not node.host_children and node.node_id not in self._protected and node.node_id not in self._fresh

    def offload_private(self, block_ids: BlockIds) -> BlockIds | None:
        """Host blocks holding copies of `block_ids` (a sequence swapped out), offloads queued; None: no room."""
        if not self._make_room(len(block_ids)):
            return None
        host_ids = self.pool.allocate(len(block_ids))
        self._pending.append(pairs_of(block_ids, host_ids))
        self.stats.num_offloaded_blocks += len(block_ids)
        self.num_swapped_blocks += len(host_ids)
        return host_ids

    def load_private(self, host_ids: BlockIds, device_ids: BlockIds) -> Pairs:
        """A swapped sequence comes back into `device_ids`: its load pairs. Its host blocks are read by them, so
        they are freed only once the result settles."""
        self._deferred.append(np.asarray(host_ids, dtype=np.int32))
        self.num_swapped_blocks -= len(host_ids)
        self.stats.num_loaded_blocks += len(host_ids)
        return pairs_of(host_ids, device_ids)

    def release_swapped(self, host_ids: BlockIds) -> None:
        """A swapped sequence ends without coming back: its host blocks are free (any pending offload into them
        still comes first, in order, and nothing reads them)."""
        self.pool.free_exclusive(host_ids)
        self.num_swapped_blocks -= len(host_ids)

    def can_make_room(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free + self.num_evictable()

    def _make_room(self, num_blocks: int) -> bool:
        """Free host blocks until `num_blocks` are free; False (freeing nothing) when it cannot."""
        short = num_blocks - self.pool.num_free
        if short <= 0:
            return True
        if short > self.num_evictable():
            return False
        self.evict(short)
        return True

    # -- host eviction --------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` host blocks of the tree if it has them: copies first (oldest load first,
        nothing is lost), then host-only leaves, least recently used first. Returns how many it freed."""
        freed = 0
        while freed < num_blocks and self._copies:
            node = self._copies.pop(next(iter(self._copies)))
            freed += len(node.host_block_ids)
            self.pool.free_exclusive(node.host_block_ids)
            node.host_block_ids = NO_BLOCKS
        while freed < num_blocks and self._leaves:
            leaf = self._leaves.pop(0)
            freed += self._free_node(leaf)
            parent = leaf.parent
            assert parent is not None, "a host leaf hangs off a node"
            del parent.host_children[leaf.token_bytes[: self.block_bytes]]
            leaf.parent = None
            if parent.parent is None:
                self.tree.drop_empty_roots()  # rare: a host leaf right under a root
            elif not len(parent.block_ids) and self._listable(parent):
                self._leaves.add(parent)
        self.num_cached_blocks -= freed
        self.stats.num_host_evicted_blocks += freed
        return freed

    def _free_node(self, node: Node) -> int:
        """Drop `node`'s host blocks (a fresh node's return to the free list only at `settle`); returns how many."""
        n = len(node.host_block_ids)
        if self._fresh.pop(node.node_id, None) is not None:
            self._deferred.append(node.host_block_ids)
        else:
            self.pool.free_exclusive(node.host_block_ids)
        node.host_block_ids = NO_BLOCKS
        return n

    def _drop_subtree(self, node: Node) -> None:
        """Free every host-only node under `node` (its prefix is leaving both tiers)."""
        stack = list(node.host_children.values())
        node.host_children = {}
        freed = 0
        while stack:
            child = stack.pop()
            self._leaves.discard(child)
            freed += self._free_node(child)
            stack.extend(child.host_children.values())
            child.parent = None
        self.num_cached_blocks -= freed
        self.stats.num_host_evicted_blocks += freed

    def drop_overlap(self, parent: Node, first_block: bytes) -> None:
        """A device insert reaches host-only `parent.host_children[first_block]`: drop that subtree (the device
        now holds fresh K/V for its first blocks; its host copy is redundant)."""
        child = parent.host_children.pop(first_block, None)
        if child is None:
            return
        self._leaves.discard(child)
        self._drop_subtree(child)
        freed = self._free_node(child)
        self.num_cached_blocks -= freed
        self.stats.num_host_evicted_blocks += freed
        child.parent = None

    def split_copy(self, node: Node, upper: Node) -> None:
        """A device split of `node` gave `upper` the head of its host copy: list it as `node` is listed."""
        registry = self._fresh if node.node_id in self._fresh else self._copies
        registry[upper.node_id] = upper

    def listed(self) -> tuple[list[Node], list[Node], list[Node], list[BlockIds]]:
        """For the recount: the host leaves in LRU order, the copies, the fresh copies, the deferred frees."""
        return list(self._leaves), list(self._copies.values()), list(self._fresh.values()), list(self._deferred)

    def gauges(self) -> dict[str, int]:
        """The host tier's `Stats` gauges."""
        return {
            "num_host_blocks_total": self.pool.num_blocks,
            "num_host_blocks_free": self.pool.num_free,
            "num_host_blocks_cached": self.num_cached_blocks,
            "num_host_blocks_swapped": self.num_swapped_blocks,
            "num_swapped_sequences": self.num_swapped_sequences,
        }

    # -- handing instructions to the worker -----------------------------------------------------------

    def take_offloads(self) -> Pairs:
        """The offloads queued since the last take (in order), for the result that carries them."""
        if not self._pending:
            return NO_PAIRS
        pairs = np.concatenate(self._pending)
        self._pending.clear()
        return pairs

    def settle(self) -> None:
        """The result being built is complete: its fresh copies become evictable, its deferred frees happen."""
        if not self._fresh and not self._deferred:  # most results (all, in a tier of none) load and free nothing
            return
        fresh = list(self._fresh.values())
        self._fresh.clear()
        for node in fresh:
            if len(node.block_ids):
                self._copies[node.node_id] = node
            elif self._listable(node):  # evicted from the device again within the result
                self._leaves.add(node)
        for host_ids in self._deferred:
            self.pool.free_exclusive(host_ids)
        self._deferred.clear()

    # -- loading host prefixes back ------------------------------------------------------------------

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
        if not node.host_children:  # the usual case (always, in a tier of none): nothing continues on the host
            return [], 0, 0
        start = Match(node, len(node.block_ids), num_matched, path=[])
        path, num_in_last, num_blocks = self.match(start, key, max_blocks)
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

    def adopt(self, parent: Node, token_bytes: bytes, fill: Callable[[BlockIds], bool]) -> Node | None:
        """Hang a host-only node of `token_bytes` under `parent` (a node boundary where the device and host match of
        these tokens ends): host blocks are made room for and allocated, `fill` writes their K/V (the disk tier),
        and the node joins the host LRU as most recently used, so an open loads it back like any host hit.

        None (nothing changes) when the host tier has no room, an allocated block is the target of an offload not
        yet handed out, or `fill` returns False. `fill` writes host memory at once: sound when the pool's worker has
        applied every earlier result (the demo's worker and radixkv's clients apply each before their next call).
        """
        first = token_bytes[: self.block_bytes]
        assert first not in parent.host_children and first not in parent.children, "adopt's caller: a miss here"
        num = len(token_bytes) // self.block_bytes
        # The host-only path down to `parent` must not make the room (as `plan_load` keeps a path it will load).
        held, node = 0, parent
        while node.parent is not None and not len(node.block_ids):
            held, node = held + len(node.host_block_ids), node.parent
        was_leaf = parent in self._leaves
        self._leaves.discard(parent)
        self._protected[parent.node_id] = (parent, held)
        try:
            room = self._make_room(num)
        finally:
            del self._protected[parent.node_id]
        if not room:
            if was_leaf:
                self._leaves.add(parent)
            return None
        host_ids = self.pool.allocate(num)
        # `fill` writes now, and an offload still queued into a block just freed would land after it: refuse those.
        queued = any(np.isin(host_ids, pairs[:, 1]).any() for pairs in self._pending)
        if queued or not fill(host_ids):
            self.pool.free_exclusive(host_ids)
            if was_leaf:
                self._leaves.add(parent)
            return None
        node = Node(token_bytes, NO_BLOCKS, parent, namespace=parent.namespace, last_access=self.tree.tick())
        node.host_block_ids = host_ids
        parent.host_children[first] = node
        self._leaves.add(node)
        self.num_cached_blocks += num
        return node

    def _split(self, node: Node, k: int) -> Node:
        """Split host-only `node` after its first `k` blocks; returns the new upper node (`node` keeps the tail)."""
        parent, bb = node.parent, self.block_bytes
        assert parent is not None and 0 < k < len(node.host_block_ids), "a host split cuts inside a host node"
        upper = Node(
            node.token_bytes[: k * bb], NO_BLOCKS, parent, namespace=node.namespace, last_access=node.last_access
        )
        upper.host_block_ids = node.host_block_ids[:k]
        parent.host_children[node.token_bytes[:bb]] = upper
        node.token_bytes, node.host_block_ids, node.parent = node.token_bytes[k * bb :], node.host_block_ids[k:], upper
        upper.host_children[node.token_bytes[:bb]] = node
        return upper


class ResultScope:
    """`KVCache.one_result()`'s scope, reentrant: when the outermost one ends, the host tier settles the result."""

    __slots__ = ("_host", "_depth")

    def __init__(self, host: HostTier) -> None:
        self._host, self._depth = host, 0

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._depth -= 1
        if not self._depth:
            self._host.settle()
