"""Recount who holds what from scratch and compare: every block's holders, every lock's, every reservation.

What tests and `CheckInvariants` run after every step; raises AssertionError naming the first thing that
disagrees. Slow on purpose (a walk of every node, sequence and block); never on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from radixkv.memory.block_pool import BlockPool, cdiv
from radixkv.sequences.sequence import LiveSequence, PreemptedSequence, path_runs
from radixkv.tree.lock_counts import lock_refs
from radixkv.tree.radix_tree import Node, RadixTree, TokenKey
from radixkv.tree.tree_check import check_tree


def check_holders(
    pool: BlockPool, tree: RadixTree, sequences: Iterable[LiveSequence], pins: Iterable[tuple[Node, int]]
) -> None:
    """Every ref_count equals the tree's hold plus the sequences' private holds; every lock_ref its holders and its
    locked children."""
    pool.check_invariants()
    check_tree(tree)
    bs = tree.block_size
    expected = np.zeros(pool.num_blocks, dtype=np.int64)
    np.add.at(expected, tree.tree_block_ids(), 1)
    holders: list[tuple[Node, int]] = list(pins)
    for seq in sequences:
        assert len(seq.block_table) == cdiv(seq.num_tokens, bs), f"seq {seq.seq_id}: table length wrong"
        table = seq.block_table.tolist()
        assert seq.block_table.last == (table[-1] if table else -1), f"seq {seq.seq_id}: table's last block stale"
        assert seq.last_block == seq.block_table.last, f"seq {seq.seq_id}: the columns' last block is stale"
        assert len(set(table)) == len(table), f"seq {seq.seq_id}: a block twice in one table"
        assert seq.num_computed_tokens <= seq.num_tokens, f"seq {seq.seq_id}: computed past its length"
        assert seq.num_tree_blocks * bs <= seq.num_computed_tokens, f"seq {seq.seq_id}: cached uncomputed tokens"
        np.add.at(expected, seq.private_blocks(), 1)
        path_tokens = sum(TokenKey.count(run) for run in _path_runs(seq.lock_node))
        assert path_tokens == seq.num_tree_blocks * bs, f"seq {seq.seq_id}: locked path length wrong"
        assert TokenKey.count(seq.tail()) == seq.num_tokens - path_tokens, f"seq {seq.seq_id}: tail tokens lost"
        assert tree.roots[seq.namespace] is _root_of(seq.lock_node), (
            f"seq {seq.seq_id}: locked path in another namespace"
        )
        private = set(seq.private_prefix.tolist())
        path = np.concatenate([np.empty(0, np.int32), *path_runs(seq.lock_node)]).tolist()
        for table_block, path_block in zip(table, path, strict=False):
            assert table_block == path_block or table_block in private, (
                f"seq {seq.seq_id}: block {table_block} neither on its path nor held"
            )
        holders.append((seq.lock_node, 1))
    locks = lock_refs(tree.roots.values(), holders)
    for node in [*tree.roots.values(), *(n for _, n in tree.nodes())]:
        expected_locks = locks.get(node.node_id, 0)
        assert node.lock_ref == expected_locks, (
            f"node {node.node_id}: lock_ref {node.lock_ref} != its holders and locked children {expected_locks}"
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
