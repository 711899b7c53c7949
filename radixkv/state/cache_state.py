"""A `KVCache`'s whole bookkeeping as plain columns, and the cache rebuilt from them exactly.

What a restart must carry over so the next process continues as if nothing happened: the tree
(nodes, their tokens and blocks, locks, pins, last access: the LRU order), the pool (ref counts and
the free stack, in order), the live sequences (tables, watermarks, what they lock or hold, their fork
families), the pins, the sequence-id counter, the stats counters and the host tier
(`radixkv.state.host_state`). Nodes are
stored as columns (numpy arrays as bytes), parents before children, so a tree of 100k nodes encodes
and decodes in numpy calls, not per-node dicts; ids of nodes are not kept, only their order (the LRU
tie-break). Integers only: no KV here.

`rebuild` trusts nothing it reads: every link is checked as it is made and the invariant checker
recounts the result, so a body that decodes but does not describe a consistent cache is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from radixkv.errors import SnapshotRefused
from radixkv.kv_cache import KVCache
from radixkv.sequences.admission import Budget, Limits
from radixkv.sequences.sequence import BlockTable, LiveSequence, PreemptedSequence
from radixkv.state.host_state import capture_host, rebuild_host, swapped_records
from radixkv.state.retention_state import capture_retention, restore_retention
from radixkv.stats import Stats
from radixkv.tree.lock_counts import holders_through, lock_refs
from radixkv.tree.radix_tree import Node

# Stats fields that are gauges, read from the structures at `stats()` time: never restored.
_GAUGES = frozenset(
    {
        "num_blocks_free",
        "num_blocks_cached",
        "num_blocks_evictable",
        "num_blocks_pinned",
        "num_blocks_in_use",
        "num_live_sequences",
        "num_namespaces",
        "num_blocks_total",
        "num_blocks_reserved",
        "num_preempted_sequences",
    }
)


def _i32(values: Any) -> bytes:
    """Block ids (an int32 array or a list of ints) as little-endian int32 bytes."""
    return np.asarray(values, dtype="<i4").tobytes()


def _ids(raw: bytes) -> npt.NDArray[np.int32]:
    """The inverse of `_i32`, in the form `Node.block_ids` holds: an int32 array of its own."""
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def capture(cache: KVCache) -> dict[str, Any]:
    """Everything `rebuild` needs, as msgpack-able values (ints, strings, bytes, lists, dicts)."""
    tree, pool = cache.tree, cache.pool
    names = list(tree.roots)
    ns_index = {name: i for i, name in enumerate(names)}
    nodes = [node for _, node in tree.nodes()]  # parents before children
    index = {id(node): i for i, node in enumerate(nodes)}

    def ref(node: Node) -> int:
        """A node's index, or -1 - (namespace index) for a namespace's root."""
        return index[id(node)] if node.parent is not None else -1 - ns_index[node.namespace]

    roots = [tree.roots[name] for name in names]
    # Locks in the stored form: holders whose locked path runs through each node (`radixkv.tree.lock_counts`).
    through = holders_through(_lock_holders(cache))
    sequences = [
        [
            s.seq_id,
            s.namespace,
            s.tail(),
            _i32(s.block_table[:]),
            ref(s.lock_node),
            s.num_tree_blocks,
            _i32(s.private_prefix),
            s.num_tokens,
            s.num_computed_tokens,
            s.priority,
            s.reserve_until,
        ]
        for s in cache._sequences
    ]
    # Tokens and watermarks; a swapped-out sequence's host blocks are in the host tier's columns.
    records = list(cache._sequences.preempted.values())
    preempted = [
        [p.seq_id, p.namespace, p.token_bytes, p.num_computed_tokens, p.priority, p.reserve_until, p.mode]
        for p in records
    ]
    pins = [[namespace, key, ref(node), 1] for (namespace, key), nodes in cache._pins._pins.items() for node in nodes]
    return {
        "block_size": cache.block_size,
        "num_blocks": pool.num_blocks,
        "clock": tree._clock,
        "next_seq_id": cache._sequences.next_seq_id,
        "namespaces": names,
        "root_lock_refs": [through[r.node_id] for r in roots],
        "nodes": {
            "parent": _i32([ref(n.parent) for n in nodes if n.parent is not None]),
            "num_blocks": _i32([len(n.block_ids) for n in nodes]),
            "blocks": _i32(np.concatenate([np.empty(0, np.int32), *(n.block_ids for n in nodes)])),
            "tokens": b"".join(n.token_bytes for n in nodes),
            "lock_ref": _i32([through[n.node_id] for n in nodes]),
            "pin_ref": _i32([n.pin_ref for n in nodes]),
            "last_access": np.asarray([n.last_access for n in nodes], dtype="<i8").tobytes(),
            "order": np.argsort(np.asarray([n.node_id for n in nodes], dtype=np.int64), kind="stable")
            .astype("<i4")
            .tobytes(),
        },
        "sequences": sequences,
        "preempted": preempted,
        "budget": [cache.budget.reserve_fraction, cache.budget.watermark_blocks],
        "pins": pins,
        "ref_counts": pool.ref_counts.astype("<i4").tobytes(),
        "free": _i32(pool._free[: pool.num_free]),
        "stats": {k: v for k, v in dataclasses.asdict(cache.stats_counters).items() if k not in _GAUGES},
        # Added in place of a format bump: a snapshot without it restores with an empty host tier. None for a tier
        # of no blocks, as before it was always there (a build that has none refuses a host state).
        "host": capture_host(cache.host, nodes, ref, records) if cache.host.enabled else None,
        # Likewise: without it, forked sequences restore without families (what they share by count is
        # published once its other holders go, as before families were kept).
        "families": _families(cache),
        "retention": capture_retention(nodes, tree.policy.clock()),  # likewise: without it, no hints
    }


def rebuild(
    state: dict[str, Any], limits: Limits | None = None, host_num_blocks: int = 0, eviction_policy: str = "lru"
) -> KVCache:
    """The cache `capture` saw, exactly: same hits (on both tiers), tables, LRU orders, free stacks, next ids,
    counters. `host_num_blocks`: this pool's host tier (a state from a pool without one restores it empty);
    `eviction_policy`: this pool's (the leaves are listed afresh under it).

    Raises:
        SnapshotRefused: (why INCONSISTENT) the state does not describe a consistent cache.
    """
    try:
        cache = _rebuild(state, limits, host_num_blocks, eviction_policy)
        cache.check_invariants()
    except SnapshotRefused:
        raise
    except (AssertionError, KeyError, IndexError, TypeError, ValueError) as e:
        raise SnapshotRefused("INCONSISTENT", f"the snapshot does not describe a consistent cache: {e}") from e
    return cache


def _rebuild(state: dict[str, Any], limits: Limits | None, host_num_blocks: int, eviction_policy: str) -> KVCache:
    num_blocks, block_size, next_seq_id = int(state["num_blocks"]), int(state["block_size"]), int(state["next_seq_id"])
    cache = KVCache(
        num_blocks,
        block_size,
        limits,
        first_seq_id=next_seq_id,
        host_num_blocks=host_num_blocks,
        eviction_policy=eviction_policy,
    )
    tree, pool = cache.tree, cache.pool
    roots = [tree.root(name) for name in state["namespaces"]]
    for root, lock_ref in zip(roots, state["root_lock_refs"], strict=True):
        root.lock_ref = int(lock_ref)
    nodes = _rebuild_nodes(tree.block_bytes, state["nodes"], roots)
    host_state = state.get("host")
    if host_state is not None:  # its size must be this pool's (a pool without a host tier has one of no blocks)
        rebuild_host(cache.host, host_state, nodes, roots)  # before any LRU list: it renumbers the nodes
    swapped = swapped_records(host_state)
    restore_retention(nodes, state.get("retention"), tree.policy.clock())  # before any node is listed

    def node_at(i: int) -> Node:
        return nodes[i] if i >= 0 else roots[-1 - i]

    for node in nodes:
        tree.count_restored(node)
        if node.pin_ref:
            tree.num_pinned_blocks += len(node.block_ids)
        if node.lock_ref == 0:
            if not node.children:
                tree.list_evictable(node)
    tree._clock = int(state["clock"])
    ref_counts = np.frombuffer(state["ref_counts"], dtype="<i4")
    free = np.frombuffer(state["free"], dtype="<i4")
    if ref_counts.size != pool.num_blocks or free.size > pool.num_blocks:
        raise ValueError(f"ref counts for {ref_counts.size} blocks, {free.size} free, in a pool of {pool.num_blocks}")
    pool.ref_counts[:] = ref_counts
    pool._free[: free.size] = free
    pool._num_free = int(free.size)
    reserve_fraction, watermark_blocks = state["budget"]
    cache.budget = Budget(float(reserve_fraction), int(watermark_blocks))
    for row in state["sequences"]:
        seq_id, namespace, tail, table, lock_at, num_tree_blocks, private, num_tokens, num_computed, rank, until = row
        lock_node = node_at(int(lock_at))
        if lock_node.namespace != namespace:
            raise ValueError(f"sequence {seq_id} locks a path in another namespace")
        seq = LiveSequence(
            int(seq_id),
            namespace=namespace,
            tail=bytes(tail),
            block_table=BlockTable.of([_ids(table)]),
            lock_node=lock_node,
            num_tree_blocks=int(num_tree_blocks),
            private_prefix=_ids(private),
            num_tokens=int(num_tokens),
            num_computed_tokens=int(num_computed),
            priority=int(rank),
            reserve_until=int(until),
        )
        cache._sequences.add(seq)
        cache._blocks.num_reserved += seq.reservation()
    for seq_id, namespace, token_bytes, num_computed, rank, until, mode in state["preempted"]:
        kept = swapped.pop(int(seq_id), None)
        if (mode == "swap") != (kept is not None) or mode not in ("swap", "recompute"):
            raise ValueError(f"sequence {seq_id}: preempted by {mode!r}, {'with' if kept else 'without'} host blocks")
        cache._sequences.preempted[int(seq_id)] = PreemptedSequence(
            seq_id=int(seq_id),
            namespace=namespace,
            token_bytes=bytes(token_bytes),
            num_computed_tokens=int(num_computed),
            priority=int(rank),
            reserve_until=int(until),
            mode=mode,
            host=kept,
        )
    if swapped:
        raise ValueError(f"host blocks of swapped sequences {sorted(swapped)} that are not preempted")
    for namespace, key, node_at_index, count in state["pins"]:
        cache._pins._pins.setdefault((namespace, bytes(key)), []).extend([node_at(int(node_at_index))] * int(count))
    _recount_locks(cache, roots, nodes)
    live = {seq.seq_id: seq for seq in cache._sequences}
    for seq_ids in state.get("families", []):
        family = {int(seq_id): live[int(seq_id)] for seq_id in seq_ids}  # KeyError: not a live sequence
        if len(family) < 2 or len(family) != len(seq_ids) or any(seq.family is not None for seq in family.values()):
            raise ValueError(f"family {seq_ids} is not a new family of two or more live sequences")
        for seq in family.values():
            seq.family = family
    known = {f.name for f in dataclasses.fields(Stats)} - _GAUGES
    for name, value in state["stats"].items():
        if name in known:  # in place: the allocator shares this record
            setattr(cache.stats_counters, name, int(value))
    return cache


def _families(cache: KVCache) -> list[list[int]]:
    """Each family of forked live sequences (`LiveSequence.family`) as its seq ids, once."""
    seen: set[int] = set()
    families = []
    for seq in cache._sequences:
        if seq.family is not None and id(seq.family) not in seen:
            seen.add(id(seq.family))
            families.append(list(seq.family))
    return families


def _lock_holders(cache: KVCache) -> list[tuple[Node, int]]:
    """Every lock on the tree as (node, count): each live sequence's and each pin's."""
    sequences, pins = cache.holders()
    return [(seq.lock_node, 1) for seq in sequences] + list(pins)


def _recount_locks(cache: KVCache, roots: list[Node], nodes: list[Node]) -> None:
    """The stored locks (holders through each node) checked against the restored holders, then set in the tree's
    own form (its holders plus its locked children)."""
    holders = _lock_holders(cache)
    through, counts = holders_through(holders), lock_refs(roots, holders)
    for node in [*roots, *nodes]:
        if node.lock_ref != through[node.node_id]:
            raise ValueError(f"node {node.node_id}: {node.lock_ref} locks stored, {through[node.node_id]} holders")
        node.lock_ref = counts[node.node_id]


def _rebuild_nodes(block_bytes: int, columns: dict[str, bytes], roots: list[Node]) -> list[Node]:
    """The non-root nodes, linked under `roots`; node ids handed out in the captured order (LRU ties)."""
    num_blocks = np.frombuffer(columns["num_blocks"], dtype="<i4")
    parents = np.frombuffer(columns["parent"], dtype="<i4").tolist()
    order = np.frombuffer(columns["order"], dtype="<i4").tolist()
    blocks = np.frombuffer(columns["blocks"], dtype="<i4")
    tokens: bytes = columns["tokens"]
    lock_refs = np.frombuffer(columns["lock_ref"], dtype="<i4").tolist()
    pin_refs = np.frombuffer(columns["pin_ref"], dtype="<i4").tolist()
    last_access = np.frombuffer(columns["last_access"], dtype="<i8").tolist()
    n = num_blocks.size
    if not (len(parents) == len(order) == len(lock_refs) == len(pin_refs) == len(last_access) == n):
        raise ValueError("node columns of different lengths")
    if sorted(order) != list(range(n)) or (n and num_blocks.min() < 1):
        raise ValueError("node order is not a permutation, or a node holds no block")
    ends = np.cumsum(num_blocks).tolist()
    if (ends[-1] if n else 0) != blocks.size or len(tokens) != blocks.size * block_bytes:
        raise ValueError("node blocks or tokens do not add up")
    nodes: list[Node | None] = [None] * n
    for i in order:  # creation order gives fresh node ids in the captured relative order
        start = ends[i] - int(num_blocks[i])
        nodes[i] = Node(
            tokens[start * block_bytes : ends[i] * block_bytes],
            blocks[start : ends[i]].astype(np.int32),
            None,
            namespace="",
            lock_ref=lock_refs[i],
            pin_ref=pin_refs[i],
            last_access=last_access[i],
        )
    linked: list[Node] = [node for node in nodes if node is not None]
    for i, node in enumerate(linked):
        p = parents[i]
        if p >= i:
            raise ValueError(f"node {i} listed before its parent {p}")
        parent = linked[p] if p >= 0 else roots[-1 - p]
        key = node.token_bytes[:block_bytes]
        if key in parent.children:
            raise ValueError(f"node {i}: its parent already has a child starting with the same block")
        node.parent, node.namespace = parent, parent.namespace
        parent.children[key] = node
    return linked
