"""Opening sequences: match each prompt, count what the batch takes, then lock every matched prefix.

Planning changes nothing, so `check_open` and `open_many` refuse the same requests.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixkv.memory.block_pairs import NO_PAIRS
from radixkv.memory.block_pool import NO_BLOCKS, cdiv
from radixkv.memory.block_table import BlockTable
from radixkv.sequences.allocation import Allocator
from radixkv.sequences.results import OpenResult, SlotPlan
from radixkv.sequences.sequence import LiveSequence, Sequences, path_runs
from radixkv.stats import Stats
from radixkv.tree.radix_node import Match, Node
from radixkv.tree.radix_tree import RadixTree
from radixkv.tree.token_ids import TokenKey

PlannedOpen = tuple[TokenKey, Node, Match]  # the prompt, its namespace's root, its cached prefix


def plan_open(tree: RadixTree, requests: list[tuple[TokenKey, Node]]) -> tuple[list[PlannedOpen], int, int]:
    """Match each prompt; returns the matches, the blocks to allocate, and the blocks newly locked.

    A fully cached prompt still recomputes its last token (the model needs its logits), so each
    match stops one token short, in whole blocks. Newly locked blocks stop being evictable, so the
    allocation must fit in what is available after them.
    """
    bs = tree.block_size
    needed = 0
    newly_locked: dict[int, int] = {}
    planned: list[PlannedOpen] = []
    for key, root in requests:
        match = tree.match(root, key.data, (key.num_tokens - 1) // bs)
        planned.append((key, root, match))
        needed += cdiv(key.num_tokens, bs) - match.num_blocks
        for node_id, num_blocks in match.unlocked_on_path():
            newly_locked[node_id] = max(newly_locked.get(node_id, 0), num_blocks)
    return planned, needed, sum(newly_locked.values())


def lock_matches(tree: RadixTree, planned: list[PlannedOpen]) -> list[tuple[TokenKey, Node, int]]:
    """Lock every planned prefix before anything is allocated, so one request's allocation cannot
    evict another's hit; returns each prompt with its locked node and matched block count."""
    locked = []
    for i, (key, root, match) in enumerate(planned):
        if i:  # an earlier item's split may have moved this item's match
            match = tree.match(root, key.data, (key.num_tokens - 1) // tree.block_size)
        node = tree.split(match)
        tree.lock(node)
        locked.append((key, node, match.num_blocks))
    return locked


def start_sequence(
    seq_id: int,
    namespace: str,
    node: Node,
    num_matched_blocks: int,
    new_blocks: npt.NDArray[np.int32],
    tail: bytes,
    block_size: int,
    priority: int = 0,
    reserve_until: int = 0,
) -> tuple[LiveSequence, OpenResult]:
    """A sequence holding the locked path to `node` plus `new_blocks` for the `tail` tokens past it, and its record.

    Every cached token counts as computed; the uncached ones start on a block boundary.
    """
    table = BlockTable.of([*path_runs(node), new_blocks])  # one copy, node arrays joined in C
    assert len(table) == num_matched_blocks + len(new_blocks), "locked path and match length disagree"
    num_cached = num_matched_blocks * block_size
    num_tokens = num_cached + TokenKey.count(tail)
    seq = LiveSequence(
        seq_id, namespace, tail, table, node, num_matched_blocks, NO_BLOCKS, num_tokens, num_cached,
        priority, reserve_until,
    )  # fmt: skip
    slots = SlotPlan(block_size, new_blocks, [0], [num_tokens - num_cached])
    return seq, OpenResult(seq_id, num_cached, table.array(), slots)


def open_planned(
    blocks: Allocator,
    sequences: Sequences,
    planned: list[PlannedOpen],
    namespaces: list[str],
    ranks: list[tuple[int, int]],
    seq_id: int | None = None,
) -> list[OpenResult]:
    """Lock every planned prefix, then allocate and start each sequence (capacity was checked by the plan).

    `ranks`: each request's (priority, reserve_until), whose reservation is taken now. `seq_id`: the
    id of the one sequence a resume brings back (otherwise each gets a new id). With a host tier, a prefix
    that continues there is loaded into the first new blocks (the result's `loads`).
    """
    bs, host = blocks.tree.block_size, blocks.host
    results = []
    locked = lock_matches(blocks.tree, planned)
    for (key, node, num_matched_blocks), namespace, (priority, until) in zip(locked, namespaces, ranks, strict=True):
        on_host = host.plan_load(key.data, node, num_matched_blocks, (key.num_tokens - 1) // bs) if host else None
        new_blocks = blocks.allocate(cdiv(key.num_tokens, bs) - num_matched_blocks)
        num_loaded, loads = 0, NO_PAIRS
        if host is not None and on_host is not None:
            node, loads = host.load_back(node, on_host, new_blocks)
            num_loaded = on_host[2]
            num_matched_blocks, new_blocks = num_matched_blocks + num_loaded, new_blocks[num_loaded:]
        tail = key.tail_after(num_matched_blocks * bs)
        new_id = sequences.next_id() if seq_id is None else seq_id
        seq, opened = start_sequence(new_id, namespace, node, num_matched_blocks, new_blocks, tail, bs, priority, until)
        if until:
            blocks.num_reserved += max(0, until - len(seq.block_table))
        sequences.add(seq)
        if host is not None:
            opened.num_host_hit_tokens, opened.loads, opened.offloads = num_loaded * bs, loads, host.take_offloads()
        results.append(opened)
    return results


def count_opens(stats: Stats, planned: list[PlannedOpen], results: list[OpenResult]) -> None:
    for (key, _, _), opened in zip(planned, results, strict=True):
        stats.num_requested_tokens += key.num_tokens
        stats.num_hit_tokens += opened.num_cached_tokens
        stats.num_host_hit_tokens += opened.num_host_hit_tokens
        stats.num_opened_sequences += 1


def lock_prefix(blocks: Allocator, sequences: Sequences, root: Node, key: TokenKey, namespace: str) -> OpenResult:
    """Start a sequence holding just the cached prefix of `key` (every token may match), allocating nothing.

    Locking cached blocks takes them from what is available, so they must fit in what reservations leave.
    """
    tree = blocks.tree
    match = tree.match(root, key.data)
    blocks.refuse_unless(match.num_newly_locked(), max(0, blocks.num_available() - blocks.num_reserved))
    node = tree.split(match)
    tree.lock(node)
    seq, opened = start_sequence(
        sequences.next_id(), namespace, node, match.num_blocks, NO_BLOCKS, b"", tree.block_size
    )
    sequences.add(seq)
    return opened
