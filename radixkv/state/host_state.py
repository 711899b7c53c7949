"""The host tier's bookkeeping as plain columns, beside `radixkv.state.cache_state`'s, and rebuilt from them exactly.

A restart keeps the host memory (the keeper holds it), so the next server must know which host blocks
hold which prefix: the host-only nodes (under `host_children`, parents before children), the device
nodes keeping a host copy (in `_copies` order: the order host eviction takes them), the host pool's ref
counts and free stack, the swapped-out sequences' host blocks and any offloads not yet handed out. The
host LRU order is the host leaves' `(last_access, node_id)`, so it is carried by the node order.

Captured only between results (no load in flight): fresh copies, protected paths and deferred frees exist
only inside one call. Integers only; `rebuild_host` checks every link, and the invariant checker recounts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from radixkv.memory.block_pairs import NO_PAIRS
from radixkv.memory.block_pool import NO_BLOCKS
from radixkv.pressure.swap import SwappedBlocks
from radixkv.sequences.sequence import PreemptedSequence
from radixkv.tree.host_tier import HostTier
from radixkv.tree.radix_tree import Node


def _i32(values: Any) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def _ids(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def host_only_nodes(parents: list[Node]) -> list[Node]:
    """Every host-only node under `parents` (roots and device nodes), each after its parent."""
    found: list[Node] = []
    for parent in parents:
        stack = list(reversed(parent.host_children.values()))
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(reversed(node.host_children.values()))
    return found


def capture_host(
    host: HostTier, device_nodes: list[Node], ref: Callable[[Node], int], preempted: list[PreemptedSequence]
) -> dict[str, Any]:
    """The host tier as msgpack-able columns; `ref` numbers a device node or root as `capture` does."""
    _, copies, fresh, deferred = host.listed()  # the LRU order is the leaves' (last_access, node_id): in "order"
    if fresh or deferred or host._protected:
        raise ValueError("the host tier is inside a result (loads in flight): capture it between results")
    hosted = host_only_nodes([*host.tree.roots.values(), *device_nodes])
    host_index = {id(node): len(device_nodes) + i for i, node in enumerate(hosted)}
    device_index = {id(node): i for i, node in enumerate(device_nodes)}

    def parent_ref(node: Node) -> int:
        assert node.parent is not None, "a host-only node hangs off a node"
        at = host_index.get(id(node.parent))
        return at if at is not None else ref(node.parent)

    pairs = np.concatenate(host._pending) if host._pending else NO_PAIRS  # left pending: capturing changes nothing
    return {
        "num_blocks": host.pool.num_blocks,
        "nodes": {
            "parent": _i32([parent_ref(n) for n in hosted]),
            "num_blocks": _i32([len(n.host_block_ids) for n in hosted]),
            "blocks": _i32(np.concatenate([NO_BLOCKS, *(n.host_block_ids for n in hosted)])),
            "tokens": b"".join(n.token_bytes for n in hosted),
            "last_access": np.asarray([n.last_access for n in hosted], dtype="<i8").tobytes(),
        },
        # Node ids of device and host-only nodes together, ranked: LRU ties on both tiers break as before.
        "order": np.argsort(np.asarray([n.node_id for n in device_nodes + hosted], dtype=np.int64), kind="stable")
        .astype("<i4")
        .tobytes(),
        "copies": _i32([device_index[id(n)] for n in copies]),
        "copy_blocks": _i32(np.concatenate([NO_BLOCKS, *(n.host_block_ids for n in copies)])),
        "swapped": [
            [p.seq_id, p.host.num_path_blocks, _i32(p.host.host_block_ids)]
            for p in preempted
            if isinstance(p.host, SwappedBlocks)
        ],
        "num_swapped_sequences": host.num_swapped_sequences,
        "pending": np.asarray(pairs, dtype="<i8").tobytes(),
        "ref_counts": host.pool.ref_counts.astype("<i4").tobytes(),
        "free": _i32(host.pool._free[: host.pool.num_free]),
    }


def swapped_records(state: dict[str, Any] | None) -> dict[int, SwappedBlocks]:
    """seq_id -> what the host tier keeps for that swapped-out sequence."""
    if state is None:
        return {}
    return {int(s): SwappedBlocks(int(n), _ids(ids)) for s, n, ids in state["swapped"]}


def rebuild_host(host: HostTier, state: dict[str, Any], device_nodes: list[Node], roots: list[Node]) -> list[Node]:
    """Fill the empty `host` from `state` and give every node its captured rank of node id; returns the host-only
    nodes. Raises ValueError (or AssertionError, IndexError) on anything inconsistent."""
    if int(state["num_blocks"]) != host.pool.num_blocks:
        raise ValueError(f"a host tier of {state['num_blocks']} blocks, this pool's has {host.pool.num_blocks}")
    columns, bb = state["nodes"], host.block_bytes
    num_blocks = np.frombuffer(columns["num_blocks"], dtype="<i4")
    parents = np.frombuffer(columns["parent"], dtype="<i4").tolist()
    last_access = np.frombuffer(columns["last_access"], dtype="<i8").tolist()
    blocks, tokens = np.frombuffer(columns["blocks"], dtype="<i4"), columns["tokens"]
    n, num_device = num_blocks.size, len(device_nodes)
    if not (len(parents) == len(last_access) == n) or (n and num_blocks.min() < 1):
        raise ValueError("host node columns of different lengths, or a host node holding no block")
    ends = np.cumsum(num_blocks).tolist()
    if (ends[-1] if n else 0) != blocks.size or len(tokens) != blocks.size * bb:
        raise ValueError("host node blocks or tokens do not add up")
    hosted: list[Node] = []
    for i in range(n):
        p, start = parents[i], ends[i] - int(num_blocks[i])
        if p >= num_device + i:
            raise ValueError(f"host node {i} listed before its parent {p}")
        parent = hosted[p - num_device] if p >= num_device else device_nodes[p] if p >= 0 else roots[-1 - p]
        node = Node(
            tokens[start * bb : ends[i] * bb], NO_BLOCKS, parent, namespace=parent.namespace, last_access=last_access[i]
        )
        node.host_block_ids = blocks[start : ends[i]].astype(np.int32)
        if node.token_bytes[:bb] in parent.host_children or node.token_bytes[:bb] in parent.children:
            raise ValueError(f"host node {i}: its parent already has a child starting with the same block")
        parent.host_children[node.token_bytes[:bb]] = node
        hosted.append(node)
    everyone = device_nodes + hosted
    order = np.frombuffer(state["order"], dtype="<i4").tolist()
    if sorted(order) != list(range(len(everyone))):
        raise ValueError("node order is not a permutation of the device and host nodes")
    for node_id, i in zip(sorted(node.node_id for node in everyone), order, strict=True):
        everyone[i].node_id = node_id
    copy_blocks, start = _ids(state["copy_blocks"]), 0
    for i in np.frombuffer(state["copies"], dtype="<i4").tolist():
        node = device_nodes[i]
        node.host_block_ids, start = copy_blocks[start : start + len(node.block_ids)], start + len(node.block_ids)
        host._copies[node.node_id] = node
    if start != copy_blocks.size:
        raise ValueError("host copies and their blocks do not add up")
    for node in hosted:
        if not node.host_children:
            host._leaves.add(node)
    host.num_cached_blocks = int(blocks.size + copy_blocks.size)
    host.num_swapped_blocks = sum(len(r.host_block_ids) for r in swapped_records(state).values())
    host.num_swapped_sequences = int(state["num_swapped_sequences"])
    pending = np.frombuffer(state["pending"], dtype="<i8").reshape(-1, 2).astype(np.int64)
    if len(pending):
        host._pending.append(pending)
    ref_counts, free = np.frombuffer(state["ref_counts"], dtype="<i4"), np.frombuffer(state["free"], dtype="<i4")
    if ref_counts.size != host.pool.num_blocks or free.size > host.pool.num_blocks:
        raise ValueError(f"host ref counts for {ref_counts.size} blocks, {free.size} free")
    host.pool.ref_counts[:] = ref_counts
    host.pool._free[: free.size] = free
    host.pool._num_free = int(free.size)
    return hosted
