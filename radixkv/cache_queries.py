"""The read-only half of `KVCache`: probes, dry runs and introspection a scheduler calls before it acts.

Nothing here changes the cache, except the refusal counters a dry run moves as the refused call
would. `KVCache` (the mutating half) inherits these, so callers see one object; the split keeps
each half one concept and a readable size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from radixkv.errors import LimitExceeded
from radixkv.memory.block_pool import BlockPool, cdiv
from radixkv.pressure.budget import Budget, budget_args, num_drawn
from radixkv.pressure.limits import Limits
from radixkv.pressure.scheduling import freeable_blocks, victims
from radixkv.pressure.swap import SwappedBlocks, num_swap_blocks, swapped_host_blocks
from radixkv.sequences.admission import PlannedOpen, plan_open
from radixkv.sequences.allocation import Allocator
from radixkv.sequences.append import append_args, append_counts, plan_batch
from radixkv.sequences.fork import check_fork
from radixkv.sequences.sequence import LiveSequence, Sequences
from radixkv.state.invariants import check_holders, check_reservations
from radixkv.stats import Stats
from radixkv.tree.host_tier import HostTier
from radixkv.tree.namespaces import DEFAULT_NAMESPACE, existing_root, namespace_root
from radixkv.tree.pins import Pins
from radixkv.tree.radix_tree import Node, RadixTree
from radixkv.tree.token_ids import TokenIds, TokenKey


class CacheQueries:
    """Questions about a cache's state; the state itself is built by `KVCache.__init__`."""

    block_size: int
    limits: Limits
    pool: BlockPool
    tree: RadixTree
    budget: Budget
    stats_counters: Stats
    _sequences: Sequences
    _pins: Pins
    _blocks: Allocator
    host: HostTier | None

    def num_available_blocks(self) -> int:
        """Free now, or free after evicting every unlocked cached block."""
        return self._blocks.num_available()

    def _root(self, namespace: str, field: str = "namespace") -> Node:
        return namespace_root(self.tree, namespace, self.limits.max_namespaces, field)

    def _key(self, token_ids: TokenIds, field: str) -> TokenKey:
        return TokenKey.of(token_ids, field, max_tokens=self.limits.max_tokens_per_request)

    def _plan_open(
        self, requests: Sequence[tuple[TokenIds, str]], max_new_tokens: Sequence[int] | None,
        priorities: Sequence[int] | None,
    ) -> tuple[list[PlannedOpen], list[tuple[int, int]], int]:  # fmt: skip
        """Validate a batch of opens and admit it before anything changes; returns the plan, each item's
        (priority, reserve_until), and what it takes from the unreserved blocks (allocated, newly locked, reserved)."""
        keys: list[tuple[TokenKey, Node]] = []
        for i, (token_ids, namespace) in enumerate(requests):
            prefix = f"requests[{i}]." if len(requests) > 1 else ""
            keys.append((self._key(token_ids, prefix + "token_ids"), self._root(namespace, prefix + "namespace")))
        reserved, ranks, budgeted = 0, [(0, 0)] * len(keys), False  # (priority, reserve_until): plain opens' fast path
        if max_new_tokens is not None or priorities is not None:
            num_tokens = [key.num_tokens for key, _ in keys]
            budgets, priority = budget_args(
                len(keys), max_new_tokens, priorities, num_tokens, self.limits.max_tokens_per_request
            )
            until = [self.budget.reserve_until(n, m, self.block_size) for n, m in zip(num_tokens, budgets, strict=True)]
            reserved = sum(max(0, u - cdiv(n, self.block_size)) for n, u in zip(num_tokens, until, strict=True))
            ranks, budgeted = list(zip(priority, until, strict=True)), any(budgets)
        planned, needed, newly_locked = plan_open(self.tree, keys)
        self.budget.admit(self._blocks, needed, newly_locked, reserved, budgeted)
        return planned, ranks, needed + newly_locked + reserved

    def can_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Would appending `num_tokens[i]` tokens to each `seq_ids[i]` (one `append_batch`) succeed?

        Changes nothing. Counts new blocks, copy-on-write copies and what eviction could free exactly
        as `append_batch` does; False where it would raise OutOfBlocks or LimitExceeded. Raises
        InvalidArgument or UnknownSequence where the query itself is malformed.
        """
        counts = append_counts(seq_ids, num_tokens, "num_tokens")
        sequences = self._sequences.batch(seq_ids)
        try:
            needed, drawn = self._num_blocks_to_append(sequences, counts)
        except LimitExceeded:
            return False
        return needed - drawn <= self._blocks.num_unreserved() and needed <= self.num_available_blocks()

    def _num_blocks_to_append(self, sequences: list[LiveSequence], counts: list[int]) -> tuple[int, int]:
        """New blocks plus copies (see `radixkv.sequences.append.plan_append`), and how many of them the sequences'
        reservations cover; changes nothing."""
        plans = plan_batch(sequences, counts, self.block_size, self.limits.max_tokens_per_request, self.pool.ref_counts)
        return sum(n for n, _ in plans), num_drawn(sequences, counts, self.block_size)

    def check_commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Raise what `commit` would raise for these arguments; changes nothing."""
        self._sequences.for_commit(seq_ids, num_tokens)

    def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        """How much `num_available_blocks()` would grow if `seq_ids` were released together, with or
        without `cache` (see `radixkv.pressure.scheduling`). Changes nothing."""
        return freeable_blocks(self.pool.ref_counts, self._sequences.batch(list(seq_ids)))

    def victims(self, num_blocks: int, among: Sequence[int] | None = None) -> list[int]:
        """Live sequences to preempt to give `num_blocks` back: lowest priority, then latest arrival, first
        (see `radixkv.pressure.scheduling.victims`); only from `among` when given (a session's own). Changes nothing."""
        candidates = list(self._sequences) if among is None else self._sequences.batch(list(among))
        return victims(self.pool.ref_counts, candidates, num_blocks)

    def match(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many leading tokens are cached on the device (whole blocks); locks and refreshes nothing."""
        return self.match_tiers(token_ids, namespace)[0]

    def match_tiers(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> tuple[int, int]:
        """(device tokens, host tokens): the leading tokens cached on the device, then how many more the host
        tier holds (an open would load those back rather than compute them). Changes nothing."""
        key = self._key(token_ids, "token_ids")
        root = existing_root(self.tree, namespace)
        if root is None:
            return 0, 0
        match = self.tree.match(root, key.data)
        num_host = self.host.match(match, key.data, key.num_tokens)[2] if self.host is not None else 0
        return match.num_blocks * self.block_size, num_host * self.block_size

    # -- dry runs: a multi-operation step checks every item before it applies any ----------------

    def check_open(
        self, requests: Sequence[tuple[TokenIds, str]], *, max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> int:  # fmt: skip
        """Raise what `open_many(...)` would raise, else return the unreserved blocks it would take
        (allocated, newly locked, reserved). Changes nothing but the refusal counters, as the refused
        `open_many` would."""
        try:
            return self._plan_open(requests, max_new_tokens, priorities)[2]
        finally:
            self.tree.drop_empty_roots()  # namespaces the dry run created

    def check_append(
        self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds, num_blocks_taken: int = 0
    ) -> None:
        """Raise what `append_batch(...)` would raise once `num_blocks_taken` of the available blocks
        are gone (to opens applied before it). Changes nothing but the allocation-failure counter."""
        counts, _ = append_args(seq_ids, num_token_ids, token_ids)
        needed, drawn = self._num_blocks_to_append(self._sequences.batch(seq_ids), counts)
        self._blocks.refuse_unless(needed - drawn, max(0, self._blocks.num_unreserved() - num_blocks_taken))

    def check_fork(self, seq_id: int, num_children: int) -> None:
        """Raise what `fork(seq_id, num_children)` would raise; changes nothing."""
        check_fork(self._sequences, seq_id, num_children, self.limits.max_fork_children)

    # -- introspection ---------------------------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table; empty while it is preempted (it holds nothing on the device)."""
        return [] if self.is_preempted(seq_id) else self._sequences.get(seq_id).block_table.tolist()

    def num_tokens(self, seq_id: int) -> int:
        record = self._sequences.preempted.get(seq_id)
        return record.num_tokens if record is not None else self._sequences.get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """The computed watermark: leading tokens whose K/V is written (see `commit`); 0 while preempted."""
        return 0 if self.is_preempted(seq_id) else self._sequences.get(seq_id).num_computed_tokens

    def reserve_until(self, seq_id: int) -> int:
        """The table length the sequence's admission reserves growth up to (0: none; see `radixkv.pressure.budget`).
        Kept while it is preempted: its resume reserves it again."""
        record = self._sequences.preempted.get(seq_id)
        return record.reserve_until if record is not None else self._sequences.get(seq_id).reserve_until

    def swap_blocks(self, seq_id: int) -> int:
        """Host-tier blocks of the sequence: those it holds while swapped out, or those `preempt(..., "swap")` would
        move there now while it is live (0 when preempted by recompute)."""
        record = self._sequences.preempted.get(seq_id)
        if record is None:
            return num_swap_blocks(self._sequences.get(seq_id))
        return len(record.host.host_block_ids) if isinstance(record.host, SwappedBlocks) else 0

    def is_preempted(self, seq_id: int) -> bool:
        return isinstance(seq_id, int) and seq_id in self._sequences.preempted

    def sequence_ids(self) -> list[int]:
        """Live sequences (see `preempted_sequence_ids` for the others)."""
        return self._sequences.ids()

    def preempted_sequence_ids(self) -> list[int]:
        return list(self._sequences.preempted)

    def stats(self) -> Stats:
        """A snapshot: gauges read now, counters accumulated since start."""
        return dataclasses.replace(
            self.stats_counters,
            num_blocks_free=self.pool.num_free,
            num_blocks_cached=self.tree.num_cached_blocks,
            num_blocks_evictable=self.tree.num_evictable_blocks,
            num_blocks_pinned=self.tree.num_pinned_blocks,
            num_blocks_in_use=self.pool.num_blocks - self.pool.num_free - self.tree.num_evictable_blocks,
            num_live_sequences=len(self._sequences),
            num_namespaces=len(self.tree.roots),
            num_blocks_reserved=self._blocks.num_reserved,
            num_preempted_sequences=len(self._sequences.preempted),
            **(self.host.gauges() if self.host is not None else {}),
        )

    def holders(self) -> tuple[Iterable[LiveSequence], Iterable[tuple[Node, int]]]:
        """The live sequences and the pins (deepest node, count): what the online audit copies."""
        return self._sequences, self._pins.holders()

    def check_invariants(self) -> None:
        """Recount everything from scratch and compare; raises AssertionError naming what broke."""
        check_holders(self.pool, self.tree, *self.holders())
        self.check_reservations()

    def check_reservations(self) -> None:
        """Admission's reservations recounted: O(live sequences), so the online audit runs it under the lock."""
        blocks, sequences = self._blocks, self._sequences
        check_reservations(blocks.num_reserved, blocks.num_available(), sequences, sequences.preempted)
        if self.host is not None:
            self.host.check_invariants(swapped_host_blocks(sequences.preempted.values()))
