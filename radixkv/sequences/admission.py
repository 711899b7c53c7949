"""Opening sequences: match each prompt, count what the batch takes, then lock every matched prefix.

Planning changes nothing, so `check_open` and `open_many` refuse the same requests. What an open takes is
here too: blocks (`Allocator`: the free stack, then eviction), the caller's caps (`Limits`) and its token
budget (`Budget`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, LimitExceeded, NotAdmitted, OutOfBlocks
from radixkv.memory.block_pool import NO_BLOCKS, BlockPool, cdiv
from radixkv.sequences.results import OpenResult, SlotPlan
from radixkv.sequences.sequence import BlockTable, LiveSequence, Sequences, path_runs
from radixkv.stats import Stats
from radixkv.tree.host_tier import HostTier
from radixkv.tree.radix_tree import Match, Node, RadixTree, TokenKey

# -- from sequences/allocation.py (merged, issue 41: one concept, one module):
# Taking blocks: from the free stack first, then by evicting unlocked cached blocks, LRU first.
#
# Reservations (admission's reserved growth, see `radixkv.sequences.admission`) are a count here, not blocks: a
# reserved block is any free or evictable one that no one else may take. So an allocation must fit in
# what the reservations leave, except for the blocks it draws on its own sequence's reservation.


class Allocator:
    """The pool and the tree's evictable blocks seen as one supply, with the counters they move.

    `num_reserved` is the sum of `LiveSequence.reservation()` over live sequences (the invariant checker
    recounts it). `host`: the host tier evictions offload to, whose transfers each result hands out (maybe a tier of
    no blocks: `HostTier.enabled`).
    """

    def __init__(self, pool: BlockPool, tree: RadixTree, stats: Stats, *, host: HostTier) -> None:
        self.pool, self.tree, self.stats, self.host = pool, tree, stats, host
        self.num_reserved = 0

    def num_available(self) -> int:
        """Free now, or free after evicting every unlocked cached block."""
        return self.pool.num_free + self.tree.num_evictable_blocks

    def num_unreserved(self) -> int:
        """What an allocation not drawing on a reservation may take: available less every reservation."""
        return max(0, self.num_available() - self.num_reserved)

    def refuse_unless(self, needed: int, available: int) -> None:
        """Raise OutOfBlocks (and count the failure) when `needed` exceeds `available`."""
        if needed > available:
            self.stats.num_allocation_failures += 1
            raise OutOfBlocks(needed, available)

    def allocate(self, n: int, drawn: int = 0) -> npt.NDArray[np.int32]:
        """`n` blocks, evicting the shortfall first; all or none. `drawn` of them come out of the
        caller's reservations (which shrink by as much); the rest must fit in what is unreserved."""
        available = self.pool.num_free + self.tree.num_evictable_blocks
        self.refuse_unless(n - drawn, max(0, available - self.num_reserved))
        self.refuse_unless(n, available)
        self.num_reserved -= drawn
        shortfall = n - self.pool.num_free
        if shortfall > 0:
            self.evict(shortfall)
        return self.pool.allocate(n)

    def evict(self, num_blocks: int, owner: str | None = None) -> int:
        """Evict up to `num_blocks` (only from `owner`'s namespaces, if given: `owner_of`); returns how many."""
        evicted = self.tree.evict(num_blocks, owner)
        self.stats.num_evicted_blocks += len(evicted)
        self.pool.free_exclusive(evicted)  # the tree was their only holder
        return len(evicted)

    def evict_checked(self, num_blocks: int, owner: str | None = None) -> int:
        """`evict` for a caller's `num_blocks`: InvalidArgument unless a non-negative integer."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise InvalidArgument("num_blocks", f"must be a non-negative integer, got {num_blocks!r}")
        return self.evict(num_blocks, owner) if num_blocks else 0


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
        seq_id,
        namespace=namespace,
        tail=tail,
        block_table=table,
        lock_node=node,
        num_tree_blocks=num_matched_blocks,
        private_prefix=NO_BLOCKS,
        num_tokens=num_tokens,
        num_computed_tokens=num_cached,
        priority=priority,
        reserve_until=reserve_until,
    )
    slots = SlotPlan(block_size=block_size, span_blocks=new_blocks, span_starts=[0], counts=[num_tokens - num_cached])
    return seq, OpenResult(seq_id=seq_id, num_cached_tokens=num_cached, block_table=table.array(), slot_source=slots)


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
    id of the one sequence a resume brings back (otherwise each gets a new id). A prefix that continues on the
    host tier is loaded into the first new blocks (the result's `loads`).
    """
    bs, host = blocks.tree.block_size, blocks.host
    results = []
    locked = lock_matches(blocks.tree, planned)
    for (key, node, num_matched_blocks), namespace, (priority, until) in zip(locked, namespaces, ranks, strict=True):
        on_host = host.plan_load(key.data, node, num_matched_blocks, (key.num_tokens - 1) // bs)
        new_blocks = blocks.allocate(cdiv(key.num_tokens, bs) - num_matched_blocks)
        node, loads = host.load_back(node, on_host, new_blocks)
        num_loaded = on_host[2]
        num_matched_blocks, new_blocks = num_matched_blocks + num_loaded, new_blocks[num_loaded:]
        tail = key.tail_after(num_matched_blocks * bs)
        new_id = sequences.next_id() if seq_id is None else seq_id
        seq, opened = start_sequence(new_id, namespace, node, num_matched_blocks, new_blocks, tail, bs, priority, until)
        if until:
            blocks.num_reserved += max(0, until - len(seq.block_table))
        sequences.add(seq)
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


# -- from pressure/limits.py (merged, issue 41: one concept, one module):
# Caps that keep one caller from taking the pool.


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Caps that keep one caller from taking the pool. Refused with `LimitExceeded` naming the cap."""

    max_tokens_per_request: int = 1 << 20
    max_fork_children: int = 1024
    max_namespaces: int = 4096
    max_pinned_fraction: float = 0.25


# -- from pressure/budget.py (merged, issue 41: one concept, one module):
# Admission by token budget: a request states `max_new_tokens`, and its growth is reserved when it is admitted.
#
# A sequence admitted with a budget reserves the blocks its table will grow by (`reserve_fraction` of
# the blocks `max_new_tokens` needs past the prompt's last block), so its appends never fail for
# lack of blocks: the reservation is a count in the `Allocator` that every other allocation must
# leave alone. It shrinks as the table grows into it, and what is left returns at release or preempt.
#
# Admitting a budgeted batch needs its uncached prompt blocks, the cached blocks it newly locks and
# its reservations to fit in the free and evictable blocks less everyone's reservations and the
# watermark (`NotAdmitted` otherwise). The watermark applies only to budgeted requests: a request
# that states no budget keeps the older contract (it takes what fits, and its caller handles
# `OutOfBlocks`), so pools filled exactly by unbudgeted opens behave as before. Reservations count
# against both kinds.


@dataclasses.dataclass(frozen=True, slots=True)
class Budget:
    """A pool's admission settings: the share of stated growth reserved, and the blocks kept free of admissions."""

    reserve_fraction: float = 1.0  # 1.0: never a preemption; lower overcommits and relies on preemption
    watermark_blocks: int = 0

    @classmethod
    def of(cls, num_blocks: int, reserve_fraction: float, watermark_fraction: float) -> Budget:
        if not 0.0 <= reserve_fraction <= 1.0:
            raise ValueError(f"reserve_fraction must lie in [0, 1], got {reserve_fraction}")
        if not 0.0 <= watermark_fraction < 1.0:
            raise ValueError(f"watermark_fraction must lie in [0, 1), got {watermark_fraction}")
        return cls(reserve_fraction, int(watermark_fraction * num_blocks))  # as vLLM's block manager rounds it

    def reserve_until(self, num_tokens: int, max_new_tokens: int, block_size: int) -> int:
        """The table length a sequence of `num_tokens` admitted with `max_new_tokens` reserves growth up to."""
        if not max_new_tokens:
            return 0
        prompt = cdiv(num_tokens, block_size)
        growth = cdiv(num_tokens + max_new_tokens, block_size) - prompt
        return prompt + math.ceil(round(self.reserve_fraction * growth, 9))  # 0.07 * 100 reserves 7, not 8

    def admit(self, blocks: Allocator, needed: int, newly_locked: int, reserved: int, budgeted: bool) -> None:
        """Raise unless `needed` new blocks, `newly_locked` cached ones and `reserved` growth fit (see the module)."""
        if budgeted:
            available = blocks.num_available() - blocks.num_reserved - self.watermark_blocks
            if needed + newly_locked + reserved > available:
                blocks.stats.num_admission_refusals += 1
                raise NotAdmitted(needed + newly_locked + reserved, max(0, available))
        else:
            blocks.refuse_unless(needed, max(0, blocks.num_available() - blocks.num_reserved - newly_locked))


def budget_args(
    num_requests: int,
    max_new_tokens: Sequence[int] | None,
    priorities: Sequence[int] | None,
    num_tokens: Sequence[int],
    max_tokens: int,
) -> tuple[list[int], list[int]]:
    """`open_many`'s per-request budgets and priorities checked (one entry per request; None: all 0)."""
    columns = []
    for name, column in (("max_new_tokens", max_new_tokens), ("priorities", priorities)):
        if column is None:
            columns.append([0] * num_requests)
            continue
        if len(column) != num_requests:
            raise InvalidArgument(name, f"needs one entry per request ({num_requests}), got {len(column)}")
        for i, value in enumerate(column):
            if type(value) is not int and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise InvalidArgument(f"{name}[{i}]", f"must be an integer, got {type(value).__name__}")
        columns.append([int(v) for v in column])
    budgets, ranks = columns
    if max_new_tokens is None:
        return budgets, ranks
    for i, (n, budget) in enumerate(zip(num_tokens, budgets, strict=True)):
        if budget < 0:
            raise InvalidArgument(f"max_new_tokens[{i}]", f"must be >= 0, got {budget}")
        if n + budget > max_tokens:
            raise LimitExceeded("max_tokens_per_request", n + budget, max_tokens)
    return budgets, ranks


def plan_admission(
    blocks: Allocator,
    budget: Budget,
    limits: Limits,
    keys: list[tuple[TokenKey, Node]],
    max_new_tokens: Sequence[int] | None,
    priorities: Sequence[int] | None,
) -> tuple[list[PlannedOpen], list[tuple[int, int]], int]:
    """Match a batch of opens (each prompt under its namespace's root) and admit it before anything changes.

    Returns the plan, each item's (priority, reserve_until), and what it takes from the unreserved blocks
    (allocated, newly locked, reserved). Raises as `KVCache.open_many` does.
    """
    reserved, ranks, budgeted = 0, [(0, 0)] * len(keys), False  # (priority, reserve_until): plain opens' fast path
    if max_new_tokens is not None or priorities is not None:
        bs, num_tokens = blocks.tree.block_size, [key.num_tokens for key, _ in keys]
        limit = limits.max_tokens_per_request
        budgets, priority = budget_args(len(keys), max_new_tokens, priorities, num_tokens, limit)
        until = [budget.reserve_until(n, m, bs) for n, m in zip(num_tokens, budgets, strict=True)]
        reserved = sum(max(0, u - cdiv(n, bs)) for n, u in zip(num_tokens, until, strict=True))
        ranks, budgeted = list(zip(priority, until, strict=True)), any(budgets)
    planned, needed, newly_locked = plan_open(blocks.tree, keys)
    budget.admit(blocks, needed, newly_locked, reserved, budgeted)
    return planned, ranks, needed + newly_locked + reserved
