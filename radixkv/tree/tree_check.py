"""Recount the radix tree (both tiers) from scratch and compare: what the invariant checks run after every step.

Raises AssertionError naming the first thing that disagrees. Slow on purpose (a walk of every node and
block); never on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from radixkv.tree.host_tier import BlockIds, HostTier
from radixkv.tree.radix_tree import RadixTree, lru_key, owner_of


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
        locked_children = sum(1 for c in node.children.values() if c.lock_ref)
        assert node.lock_ref >= locked_children, (
            f"node {node.node_id}: lock_ref {node.lock_ref} < its {locked_children} locked children"
        )
        assert node.pin_ref >= sum(c.pin_ref for c in node.children.values()), (
            f"node {node.node_id}: pin_ref below children's"
        )
        cached += len(node.block_ids)
        if node.lock_ref == 0:  # a locked node's access is written when its last lock goes (`RadixTree.move_lock`)
            for child in node.children.values():
                assert node.last_access >= child.last_access, f"node {node.node_id} accessed before its child"
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
        assert root.lock_ref >= sum(1 for c in root.children.values() if c.lock_ref), (
            f"root of {namespace!r}: lock_ref below its locked children"
        )
    assert evictable == tree.num_evictable_blocks, f"evictable blocks {tree.num_evictable_blocks} != {evictable}"
    assert pinned == tree.num_pinned_blocks, f"pinned blocks {tree.num_pinned_blocks} != {pinned}"
    assert cached == tree.num_cached_blocks, f"cached blocks {tree.num_cached_blocks} != {cached}"
    assert cached_in == tree.num_cached_blocks_in, (
        f"cached blocks per namespace {tree.num_cached_blocks_in} != {cached_in}"
    )
    cached_of: dict[str, int] = {}
    for namespace, n in cached_in.items():
        cached_of[owner_of(namespace)] = cached_of.get(owner_of(namespace), 0) + n
    assert cached_of == tree.num_cached_blocks_of, f"cached blocks per owner {tree.num_cached_blocks_of} != {cached_of}"
    listed = tree.evictable_leaves()
    assert {n.node_id for n in listed} == leaves, "evictable leaf list != unlocked leaves"
    by_owner: dict[str, set[int]] = {}
    for node in listed:
        by_owner.setdefault(owner_of(node.namespace), set()).add(node.node_id)
    owners = tree.evictable_leaves_by_owner()
    assert {o: {n.node_id for n in nodes} for o, nodes in owners.items()} == by_owner, (
        "an owner's evictable leaves != the evictable leaves of its namespaces"
    )
    for owner, nodes in owners.items():
        keys = [lru_key(n) for n in nodes]
        assert keys == sorted(keys), f"owner {owner!r}'s leaves out of LRU order: a listed last_access was written"
    tree.check_order(listed)
    assert len(listed) == len(leaves), "a leaf is listed twice"


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
