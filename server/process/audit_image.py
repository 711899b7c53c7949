"""A consistent copy of one pool's bookkeeping, taken over short lock holds and recounted with no lock held.

The online audit must not stop service for longer than a bounded slice, whatever the pool's size, so
it never recounts under the lock; it copies. Each hold copies tree nodes (with their blocks' hashes)
until its time budget is spent; between holds the tree's `touched` set collects every node an RPC
wrote, and the next hold copies those again (or drops them, if evicted). The image is complete in
the hold that finds nothing left to walk and nothing touched. That hold also copies what grows with
live sequences and namespaces, not with the cache (sequences, pins, roots, counters, the event hub's
digests), the ref counts and free list (two array copies), and runs the ledger's check (O(live
sequences)). So the image is the pool as it was at that instant, and `check` runs on it the same
recount the tests run (`check_holders`) plus the digest recount, off the lock.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import numpy.typing as npt

from radixkv.memory.block_pool import BlockPool
from radixkv.sequences.invariants import check_holders
from radixkv.sequences.sequence import LiveSequence
from radixkv.server.rules.pools import Pool
from radixkv.tree.block_hash import digest_of, wire_hash
from radixkv.tree.radix_tree import Node, RadixTree, lru_key, owner_of


def compare_digests(wires: dict[str, list[int]], num_blocks: dict[str, int], digests: dict[str, int]) -> None:
    """The hub's per-namespace block counts and digests equal a recount of the tree's wire hashes."""
    counts = {namespace: len(w) for namespace, w in wires.items() if w}
    assert counts == num_blocks, f"event hub block counts {num_blocks} != recount {counts}"
    for namespace, namespace_wires in wires.items():
        recount = digest_of(namespace_wires)
        assert digests.get(namespace) == recount, (
            f"namespace {namespace!r}: event hub digest {digests.get(namespace)} != recount {recount}"
        )


@dataclasses.dataclass(slots=True, kw_only=True)
class _NodeCopy:
    node_id: int
    namespace: str
    token_bytes: bytes  # immutable: shared, not copied
    block_ids: npt.NDArray[np.int32]  # never written in place by the tree: shared, not copied
    hashes: list[bytes | None]  # the hub's hash of each block; None: missing from its table
    children: dict[bytes, int]  # first block's bytes -> child node id
    lock_ref: int
    pin_ref: int
    last_access: int
    listed: bool  # found on the evictable list under its current key
    host_children: dict[bytes, Node]  # the host tier's nodes under it (a root with only those stays)


def _copy(node: Node, tree: RadixTree, pool: Pool) -> _NodeCopy:
    get = pool.events.hashes.get
    return _NodeCopy(
        node_id=node.node_id,
        namespace=node.namespace,
        token_bytes=node.token_bytes,
        block_ids=node.block_ids,
        hashes=[get(b) for b in node.block_ids.tolist()],
        children={k: c.node_id for k, c in node.children.items()},
        lock_ref=node.lock_ref,
        pin_ref=node.pin_ref,
        last_access=node.last_access,
        listed=node.parent is not None and tree.is_listed_evictable(node),
        host_children=dict(node.host_children),
    )


@dataclasses.dataclass(slots=True, kw_only=True)
class _Instant:
    """What the completing hold copies: everything but the tree's non-root nodes."""

    roots: list[_NodeCopy]
    sequences: list[LiveSequence]  # copies whose lock_node is still the live node (relinked by `check`)
    pins: list[tuple[int, int]]  # (node id, pins)
    pool: BlockPool
    counters: tuple[int, int, int, dict[str, int]]  # evictable, pinned, cached, cached per namespace
    num_listed: int
    num_hashes: int
    digests: dict[str, int]
    num_blocks: dict[str, int]
    ledger_violation: str | None


class _TreeImage(RadixTree):
    """A tree rebuilt from copies, for `check_holders`; its evictable list is the nodes found listed."""

    def __init__(self, block_size: int, *, roots: dict[str, Node], listed: list[Node], instant: _Instant) -> None:
        super().__init__(block_size)
        self.roots = roots
        self._listed = sorted(listed, key=lru_key)
        evictable, pinned, cached, cached_in = instant.counters
        self.num_evictable_blocks, self.num_pinned_blocks, self.num_cached_blocks = evictable, pinned, cached
        self.num_cached_blocks_in = cached_in
        for namespace, n in cached_in.items():  # the owners' counts are the namespaces' (the live tree's: its check)
            self.num_cached_blocks_of[owner_of(namespace)] = self.num_cached_blocks_of.get(owner_of(namespace), 0) + n

    def evictable_leaves(self) -> list[Node]:
        return self._listed

    def evictable_leaves_by_owner(self) -> dict[str, list[Node]]:
        """The nodes found listed, by owner (the live tree's owner lists are its own check's)."""
        by_owner: dict[str, list[Node]] = {}
        for node in self._listed:
            by_owner.setdefault(owner_of(node.namespace), []).append(node)
        return by_owner


class PoolImage:
    """Build with `step` (under the pool's lock, until it returns True; `abort` to give up), then `check`."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._copies: dict[int, _NodeCopy] = {}
        self._stack: list[Node] | None = None  # nodes still to walk; None: not started
        self._instant: _Instant | None = None
        self.num_holds = 0

    def step(self, budget_seconds: float) -> bool:
        """Copy for about `budget_seconds` (call under the pool's lock); True once the image is complete."""
        deadline = time.perf_counter() + budget_seconds
        pool, tree = self._pool, self._pool.cache.tree
        self.num_holds += 1
        if self._stack is None:
            tree.touched = set()
            self._stack = [child for root in tree.roots.values() for child in root.children.values()]
        touched = tree.touched
        assert touched is not None, "another audit reset the tree's touched set"
        while touched:  # written since its copy (or new): copy again, or forget it if evicted
            node = touched.pop()
            if node.parent is not None and len(node.block_ids):  # on the device (not gone, not moved to the host)
                self._copies[node.node_id] = _copy(node, tree, pool)
            elif tree.roots.get(node.namespace) is not node:
                self._copies.pop(node.node_id, None)
            if time.perf_counter() > deadline:
                return False
        stack = self._stack
        while stack:
            node = stack.pop()
            if node.parent is not None and len(node.block_ids):  # else evicted since it was stacked
                self._copies[node.node_id] = _copy(node, tree, pool)
                stack.extend(node.children.values())
            if time.perf_counter() > deadline:
                return False
        self._instant = self._take_instant()
        tree.touched = None
        return True

    def abort(self) -> None:
        """Stop the tree collecting writes (call under the pool's lock)."""
        self._pool.cache.tree.touched = None

    def _take_instant(self) -> _Instant:
        pool, tree, hub = self._pool, self._pool.cache.tree, self._pool.events
        sequences, pins = pool.cache.holders()
        try:
            pool.ledger.check_invariants(pool.cache)
            pool.cache.check_reservations()
            ledger_violation = None
        except AssertionError as e:
            ledger_violation = f"ledger: {e}"
        return _Instant(
            roots=[_copy(root, tree, pool) for root in tree.roots.values()],
            sequences=[s.image() for s in sequences],
            pins=[(node.node_id, count) for node, count in pins],
            pool=pool.cache.pool.copy(),
            counters=(
                tree.num_evictable_blocks,
                tree.num_pinned_blocks,
                tree.num_cached_blocks,
                dict(tree.num_cached_blocks_in),
            ),
            num_listed=tree.num_listed_evictable,
            num_hashes=len(hub.hashes),
            digests=dict(hub.digests),
            num_blocks=dict(hub.num_blocks),
            ledger_violation=ledger_violation,
        )

    def check(self) -> None:
        """Recount the image (no lock needed); raises AssertionError naming the first divergence."""
        instant = self._instant
        assert instant is not None, "check before the image is complete"
        if instant.ledger_violation is not None:
            raise AssertionError(instant.ledger_violation)
        copies = [*self._copies.values(), *instant.roots]
        nodes = {
            c.node_id: Node(
                c.token_bytes,
                c.block_ids,
                None,
                namespace=c.namespace,
                children={},
                lock_ref=c.lock_ref,
                pin_ref=c.pin_ref,
                last_access=c.last_access,
                node_id=c.node_id,
                host_children=c.host_children,
            )
            for c in copies
        }
        for c in copies:
            node = nodes[c.node_id]
            for key, child_id in c.children.items():
                assert child_id in nodes, f"node {c.node_id}: child {child_id} is missing from the audit's copy"
                node.children[key] = nodes[child_id]
                nodes[child_id].parent = node
        roots = {c.namespace: nodes[c.node_id] for c in instant.roots}
        for c in self._copies.values():
            assert nodes[c.node_id].parent is not None, f"node {c.node_id} was copied but no parent holds it"
        listed = [nodes[c.node_id] for c in self._copies.values() if c.listed]
        assert instant.num_listed == len(listed), (
            f"evictable leaf list holds {instant.num_listed} entries, {len(listed)} nodes found in it under their keys"
        )
        tree = _TreeImage(self._pool.cache.block_size, roots=roots, listed=listed, instant=instant)
        sequences = instant.sequences
        for seq in sequences:
            assert seq.lock_node.node_id in nodes, f"seq {seq.seq_id}: locked node is not in the tree"
            seq.lock_node = nodes[seq.lock_node.node_id]
        pins = [(nodes[node_id], count) for node_id, count in instant.pins]
        check_holders(instant.pool, tree, sequences, pins)
        wires: dict[str, list[int]] = {}
        for c in self._copies.values():
            missing = [b for b, h in zip(c.block_ids.tolist(), c.hashes, strict=True) if h is None]
            assert not missing, f"node {c.node_id}: blocks {missing} missing from the hash table"
            wires.setdefault(c.namespace, []).extend(wire_hash(h) for h in c.hashes if h is not None)
        num_tree_blocks = sum(len(w) for w in wires.values())
        assert instant.num_hashes == num_tree_blocks, (
            f"hash table out of step with the tree: {instant.num_hashes} entries, {num_tree_blocks} cached blocks"
        )
        compare_digests(wires, instant.num_blocks, instant.digests)
