"""Recount the core's bookkeeping from scratch and compare: what tests and `CheckInvariants` run after every step.

Raises AssertionError naming the first thing that disagrees. Slow on purpose (a walk of every
node, sequence and block); never on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from radixkv.memory.block_pool import BlockPool, cdiv
from radixkv.sequences.sequence import LiveSequence, PreemptedSequence, path_runs
from radixkv.tree.radix_node import Node, lru_key
from radixkv.tree.token_ids import TokenKey

if TYPE_CHECKING:
    from radixkv.tree.host_loading import BlockIds
    from radixkv.tree.host_tier import HostTier  # which calls `check_host_tier` from here
    from radixkv.tree.radix_tree import RadixTree  # which calls `check_tree` from here


def check_tree(tree: RadixTree) -> None:
    """Links, lock and pin counts, the cached/evictable/pinned totals and the LRU list's order."""
    seen: set[int] = set()
    evictable = pinned = cached = 0
    leaves = set()
    cached_in: dict[str, int] = {}
    bb = tree.block_bytes
    for namespace, node in tree.nodes():
        cached_in[namespace] = cached_in.get(namespace, 0) + len(node.block_ids)
        assert len(node.block_ids), f"node {node.node_id} holds no block"
        assert len(node.token_bytes) == len(node.block_ids) * bb, f"node {node.node_id}: tokens and blocks disagree"
        assert node.parent is not None and node.parent.children.get(node.token_bytes[:bb]) is node, (
            f"node {node.node_id}: parent link broken"
        )
        assert node.block_ids.dtype == np.int32 and node.block_ids.ndim == 1, f"node {node.node_id}: not an int32 run"
        for block_id in node.block_ids.tolist():
            assert block_id not in seen, f"block {block_id} held by two tree nodes"
            seen.add(block_id)
        child_locks = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_locks, f"node {node.node_id}: lock_ref {node.lock_ref} < children's {child_locks}"
        assert node.pin_ref >= sum(c.pin_ref for c in node.children.values()), (
            f"node {node.node_id}: pin_ref below children's"
        )
        for child in node.children.values():
            assert node.last_access >= child.last_access, f"node {node.node_id} accessed before its child"
        cached += len(node.block_ids)
        if node.lock_ref == 0:
            evictable += len(node.block_ids)
            if not node.children:
                leaves.add(node.node_id)
        if node.pin_ref:
            pinned += len(node.block_ids)
    for namespace, root in tree.roots.items():
        assert root.namespace == namespace, f"root of {namespace!r} is filed under another name"
        assert root.children or root.host_children or root.lock_ref, (
            f"namespace {namespace!r} holds nothing and should be gone"
        )
        assert root.lock_ref >= sum(c.lock_ref for c in root.children.values()), (
            f"root of {namespace!r}: lock_ref below children's"
        )
    assert evictable == tree.num_evictable_blocks, f"evictable blocks {tree.num_evictable_blocks} != {evictable}"
    assert pinned == tree.num_pinned_blocks, f"pinned blocks {tree.num_pinned_blocks} != {pinned}"
    assert cached == tree.num_cached_blocks, f"cached blocks {tree.num_cached_blocks} != {cached}"
    assert cached_in == tree.num_cached_blocks_in, (
        f"cached blocks per namespace {tree.num_cached_blocks_in} != {cached_in}"
    )
    listed = tree.evictable_leaves()
    assert {n.node_id for n in listed} == leaves, "evictable leaf list != unlocked leaves"
    keys = [lru_key(n) for n in listed]
    assert keys == sorted(keys), "evictable leaf list out of LRU order: a listed node's last_access was written"
    assert len(listed) == len(leaves), "a leaf is listed twice"


def check_holders(
    pool: BlockPool, tree: RadixTree, sequences: Iterable[LiveSequence], pins: Iterable[tuple[Node, int]]
) -> None:
    """Every ref_count equals the tree's hold plus the sequences' private holds; every lock_ref its holders."""
    pool.check_invariants()
    check_tree(tree)
    bs = tree.block_size
    expected = np.zeros(pool.num_blocks, dtype=np.int64)
    np.add.at(expected, tree.tree_block_ids(), 1)
    locks: dict[int, int] = {}
    for seq in sequences:
        assert len(seq.block_table) == cdiv(seq.num_tokens, bs), f"seq {seq.seq_id}: table length wrong"
        table = seq.block_table.tolist()
        assert seq.block_table.last == (table[-1] if table else -1), f"seq {seq.seq_id}: table's last block stale"
        assert len(set(table)) == len(table), f"seq {seq.seq_id}: a block twice in one table"
        assert seq.num_computed_tokens <= seq.num_tokens, f"seq {seq.seq_id}: computed past its length"
        assert seq.num_tree_blocks * bs <= seq.num_computed_tokens, f"seq {seq.seq_id}: cached uncomputed tokens"
        np.add.at(expected, seq.private_blocks(), 1)
        path_tokens = sum(TokenKey.count(run) for run in _path_runs(seq.lock_node))
        assert path_tokens == seq.num_tree_blocks * bs, f"seq {seq.seq_id}: locked path length wrong"
        assert TokenKey.count(seq.tail_bytes) == seq.num_tokens - path_tokens, f"seq {seq.seq_id}: tail tokens lost"
        assert tree.roots[seq.namespace] is _root_of(seq.lock_node), (
            f"seq {seq.seq_id}: locked path in another namespace"
        )
        private = set(seq.private_prefix.tolist())
        path = np.concatenate([np.empty(0, np.int32), *path_runs(seq.lock_node)]).tolist()
        for table_block, path_block in zip(table, path, strict=False):
            assert table_block == path_block or table_block in private, (
                f"seq {seq.seq_id}: block {table_block} neither on its path nor held"
            )
        _count_path(seq.lock_node, locks, 1)
    for node, count in pins:
        _count_path(node, locks, count)
    for node in [*tree.roots.values(), *(n for _, n in tree.nodes())]:
        assert node.lock_ref == locks.get(node.node_id, 0), (
            f"node {node.node_id}: lock_ref {node.lock_ref} != holders {locks.get(node.node_id, 0)}"
        )
    wrong = np.flatnonzero(pool.ref_counts != expected)
    if wrong.size:
        block_id = int(wrong[0])
        raise AssertionError(f"block {block_id}: ref_count {pool.ref_counts[block_id]} != holders {expected[block_id]}")
    cached = tree.tree_block_ids()
    shared = cached[pool.ref_counts[cached] != 1]
    assert not shared.size, f"cached block {int(shared[0])} is also held by count"


def _path_runs(node: Node) -> Iterable[bytes]:
    while node.parent is not None:
        yield node.token_bytes
        node = node.parent


def _root_of(node: Node) -> Node:
    while node.parent is not None:
        node = node.parent
    return node


def _count_path(node: Node | None, locks: dict[int, int], count: int) -> None:
    """Add `count` locks to `node` and every ancestor, the namespace's root included."""
    while node is not None:
        locks[node.node_id] = locks.get(node.node_id, 0) + count
        node = node.parent


def check_host_tier(host: HostTier, swapped: Iterable[BlockIds]) -> None:
    """Residency and host blocks: every host-only node hangs off `host_children` with only host-only children;
    a device node's host copy is whole and listed; each held host block has exactly one holder (a node, a
    swapped sequence, or a free deferred to the end of the result); the LRU list is the host-only leaves, in
    order; the cached count is right."""
    tree, bb = host.tree, host.block_bytes
    host.pool.check_invariants()
    leaves, copies, fresh, deferred = host.listed()
    holders: list[int] = [b for run in (*swapped, *deferred) for b in run]
    num_cached = 0
    expected_leaves = set()
    device_nodes = [*tree.roots.values(), *(node for _, node in tree.nodes())]
    listed_copies = {n.node_id for n in (*copies, *fresh)}
    assert len(listed_copies) == len(copies) + len(fresh), "a host copy is listed twice"
    for node in device_nodes:
        if len(node.host_block_ids):
            assert len(node.host_block_ids) == len(node.block_ids), f"node {node.node_id}: host copy not whole"
            assert node.node_id in listed_copies, f"node {node.node_id}: host copy not listed"
            holders.extend(node.host_block_ids)
            num_cached += len(node.host_block_ids)
        stack = list(node.host_children.items())
        while stack:
            first, child = stack.pop()
            assert child.parent is not None and child.parent.host_children.get(first) is child, (
                f"host node {child.node_id}: parent link broken"
            )
            assert first == child.token_bytes[:bb], f"host node {child.node_id}: filed under other tokens"
            assert not len(child.block_ids) and not child.children, f"host node {child.node_id} holds device blocks"
            assert len(child.host_block_ids), f"host node {child.node_id} holds no block"
            assert len(child.token_bytes) == len(child.host_block_ids) * bb, f"host node {child.node_id}: tokens"
            assert child.lock_ref == 0, f"host node {child.node_id} is locked"
            assert child.namespace == node.namespace, f"host node {child.node_id} in another namespace"
            holders.extend(child.host_block_ids)
            num_cached += len(child.host_block_ids)
            if not child.host_children and child.node_id not in listed_copies:  # a fresh one is listed at settle
                expected_leaves.add(child.node_id)
            stack.extend(child.host_children.items())
    assert {n.node_id for n in copies} <= {n.node_id for n in device_nodes if len(n.block_ids)}, (
        "a listed host copy is not on a device node"
    )
    assert len(set(holders)) == len(holders), "a host block has two holders"
    used = {int(b) for b in np.flatnonzero(host.pool.ref_counts)}
    assert used == {int(b) for b in holders}, f"host blocks held {sorted(used)} != holders {sorted(holders)}"
    assert num_cached == host.num_cached_blocks, f"host cached blocks {host.num_cached_blocks} != {num_cached}"
    assert {n.node_id for n in leaves} == expected_leaves and len(leaves) == len(expected_leaves), (
        "host LRU list != host-only leaves"
    )
    keys = [lru_key(n) for n in leaves]
    assert keys == sorted(keys), "host LRU list out of order"


def check_reservations(
    num_reserved: int, num_available: int, sequences: Iterable[LiveSequence], preempted: dict[int, PreemptedSequence]
) -> None:
    """Admission's reservations recounted, and backed by free or evictable blocks; preempted sequences apart.

    Backing can fall short by at most the blocks sequences hold as duplicates of the tree's (a publish
    that finds its prefix already cached locks the tree's copy and keeps its own), never more. A
    preempted sequence holds nothing on the device: `check_holders` counts only live sequences' holds.
    """
    live = list(sequences)
    recounted = sum(max(0, seq.reserve_until - len(seq.block_table)) for seq in live)
    assert num_reserved == recounted, f"reserved blocks {num_reserved} != recounted {recounted}"
    duplicates = len({b for seq in live for b in seq.private_prefix.tolist()})
    assert num_available + duplicates >= num_reserved, (
        f"reservations {num_reserved} exceed available blocks {num_available} (+{duplicates} duplicates)"
    )
    live_ids = {seq.seq_id for seq in live}
    for seq_id, record in preempted.items():
        assert record.seq_id == seq_id and seq_id not in live_ids, f"seq {seq_id}: both live and preempted"
        assert record.mode in ("swap", "recompute"), f"seq {seq_id}: preempted in unknown mode {record.mode!r}"
        assert len(record.token_bytes) % TokenKey.num_bytes(1) == 0, f"seq {seq_id}: preempted tokens torn"
        assert record.num_computed_tokens <= record.num_tokens, f"seq {seq_id}: computed past its length"
