"""Sequences over a block pool and a radix tree: open, append, fork, cache, release, preempt, resume, pin.

`KVCache` is the core's one public object, a facade over the modules that do each job (admission, budget,
append, fork, publish, preemption, pins, scheduling, invariants): its methods check arguments and hand over.
It tracks integers only: which blocks each sequence's block table holds, which prefixes the tree caches,
who holds what. Data never moves here; when a write would land in a shared block, the caller gets a
`(src_block, dst_block)` copy. Queries and dry runs (`can_append`, `check_*`, `victims`, ...) change nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from radixkv.errors import LimitExceeded, RadixKVError
from radixkv.memory.block_pool import BlockPool
from radixkv.pressure.preemption import Preemption, PreemptResult, ResumeResult
from radixkv.pressure.scheduling import freeable_blocks, victims
from radixkv.pressure.swap import HostSwap, SwappedBlocks, num_swap_blocks, swapped_host_blocks
from radixkv.sequences.admission import (
    Allocator,
    Budget,
    Limits,
    PlannedOpen,
    count_opens,
    lock_prefix,
    open_planned,
    plan_admission,
)
from radixkv.sequences.append import append, append_args, append_counts, append_many_args, check_fork, fork, plan_batch
from radixkv.sequences.invariants import check_holders, check_reservations
from radixkv.sequences.publish import publish, release
from radixkv.sequences.results import AppendBatch, AppendResult, OpenResult
from radixkv.sequences.retain import expire, retain
from radixkv.sequences.sequence import LiveSequence, Sequences
from radixkv.stats import Stats
from radixkv.tree.eviction import NO_RETENTION, Retention, make_policy
from radixkv.tree.host_tier import HostTier, ResultScope
from radixkv.tree.pins import Pins
from radixkv.tree.radix_tree import (
    DEFAULT_NAMESPACE,
    Node,
    RadixTree,
    TokenIds,
    TokenKey,
    existing_root,
    namespace_root,
)
from radixkv.tree.tree_check import check_host_tier

__all__ = ["DEFAULT_NAMESPACE", "KVCache", "Limits"]


class KVCache:
    """A paged KV cache with prefix sharing: the in-process core of radixkv.

    Who holds a block: the tree holds the blocks of its nodes (ref_count 1, always exactly: the
    tree never shares a block by count); a live sequence holds the blocks on its locked tree path
    through the lock (one walk of the path's nodes, whatever its length) and every other block of
    its table by ref_count. So a 128k-token hit costs a lock walk, not 8k increments, and an
    unlocked cached block is always reclaimable. Every error leaves every count as it was.
    Admission's reserved growth is a count no one else may allocate from (`radixkv.sequences.admission`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        limits: Limits | None = None,
        *,
        reserve_fraction: float = 1.0,
        watermark_fraction: float = 0.01,
        first_seq_id: int = 1,
        tree: RadixTree | None = None,
        host_num_blocks: int = 0,
        eviction_policy: str = "lru",
    ) -> None:
        """`reserve_fraction`: share of a request's growth reserved at admission; `watermark_fraction`: of the pool
        kept from budgeted admissions (`radixkv.sequences.admission`). `first_seq_id`: where sequence ids start (fresh
        per server run: an old id names nothing). `eviction_policy`: `radixkv.tree.eviction.POLICIES`, unless a
        `tree` is given. `host_num_blocks`: the host tier's size; 0: a tier of none (`HostTier.enabled`), evicted
        prefixes are dropped."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.limits = limits or Limits()
        self.pool = BlockPool(num_blocks)
        self.tree = tree or RadixTree(block_size, policy=make_policy(eviction_policy, block_size))
        self.stats_counters = Stats(num_blocks_total=num_blocks)
        self.host = HostTier(host_num_blocks, self.tree, self.stats_counters)  # always there: maybe of no blocks
        self._sequences = Sequences(first_seq_id)
        self._pins = Pins(self.tree)
        self._blocks = Allocator(self.pool, self.tree, self.stats_counters, host=self.host)
        self.budget = Budget.of(num_blocks, reserve_fraction, watermark_fraction)
        swap = HostSwap(self._blocks, self.host, self._root)
        self.preemption = Preemption(self._blocks, self._sequences, self._root, swap=swap)
        self._result_scope = ResultScope(self.host)

    def _root(self, namespace: str, field: str = "namespace") -> Node:
        return namespace_root(self.tree, namespace, self.limits.max_namespaces, field)

    def _key(self, token_ids: TokenIds, field: str) -> TokenKey:
        return TokenKey.of(token_ids, field, max_tokens=self.limits.max_tokens_per_request)

    def one_result(self) -> ResultScope:
        """`with cache.one_result():` calls inside hand the worker one result: it applies all their offloads, then
        all their copies, then all their loads (a server step is one). Until the outermost scope ends, no host
        block a load reads is reused by an offload (see `radixkv.tree.host_tier`); each call outside any scope is
        one result by itself."""
        return self._result_scope

    # -- open ------------------------------------------------------------------------------------

    def open(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, *, max_new_tokens: int = 0, priority: int = 0
    ) -> OpenResult:
        """Start a sequence: reuse the longest cached prefix, allocate blocks for the rest.

        A fully cached prompt still recomputes its last token (the model needs its logits), so the match stops
        one token short, in whole blocks. With `max_new_tokens`, admission by token budget (its growth reserved,
        or NotAdmitted). Raises InvalidArgument, LimitExceeded, OutOfBlocks, NotAdmitted; then nothing changes.
        """
        budgets, ranks = [max_new_tokens] if max_new_tokens else None, [priority] if priority else None  # None: all 0
        return self.open_many([(token_ids, namespace)], max_new_tokens=budgets, priorities=ranks)[0]

    def open_many(
        self,
        requests: Sequence[tuple[TokenIds, str]],
        *,
        max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[OpenResult]:
        """Open several sequences, all or none (one scheduler step's admissions); `max_new_tokens[i]` and
        `priorities[i]` as `open` takes them (None: all 0)."""
        planned, ranks, _ = self._plan_open(requests, max_new_tokens, priorities)
        with self._result_scope:
            opened = open_planned(self._blocks, self._sequences, planned, [ns for _, ns in requests], ranks)
        count_opens(self.stats_counters, planned, opened)
        return opened

    def check_open(
        self,
        requests: Sequence[tuple[TokenIds, str]],
        *,
        max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> int:
        """Raise what `open_many(...)` would raise, else return the unreserved blocks it would take (allocated,
        newly locked, reserved). Changes nothing but the refusal counters, as the refused `open_many` would."""
        try:
            return self._plan_open(requests, max_new_tokens, priorities)[2]
        finally:
            self.tree.drop_empty_roots()  # namespaces the dry run created

    def _plan_open(
        self,
        requests: Sequence[tuple[TokenIds, str]],
        max_new_tokens: Sequence[int] | None,
        priorities: Sequence[int] | None,
    ) -> tuple[list[PlannedOpen], list[tuple[int, int]], int]:
        """Validate a batch of opens and admit it before anything changes (see `plan_admission`)."""
        try:
            keys = [
                (
                    self._key(token_ids, f"requests[{i}].token_ids" if len(requests) > 1 else "token_ids"),
                    self._root(namespace, f"requests[{i}].namespace" if len(requests) > 1 else "namespace"),
                )
                for i, (token_ids, namespace) in enumerate(requests)
            ]
            return plan_admission(self._blocks, self.budget, self.limits, keys, max_new_tokens, priorities)
        except RadixKVError:
            self.tree.drop_empty_roots()  # namespaces this refused request created
            raise

    def lock_prefix(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> OpenResult:
        """Lock the cached prefix of `token_ids` (whole blocks) without allocating anything: a sequence holding just
        that prefix (all computed, no slots) until `release`, appendable. Unlike `open`, the match may cover every
        token (pass `token_ids[:-1]` to keep the last for the model). A miss gives an empty sequence."""
        key = self._key(token_ids, "token_ids")
        try:
            opened = lock_prefix(self._blocks, self._sequences, self._root(namespace), key, namespace)
        except RadixKVError:
            self.tree.drop_empty_roots()
            raise
        self.stats_counters.num_opened_sequences += 1
        return opened

    # -- append, commit --------------------------------------------------------------------------

    def append(self, seq_id: int, token_ids: TokenIds) -> AppendResult:
        """Reserve slots for new tokens, copy-on-write of a shared last block; earlier tokens count as computed
        from now on (see `commit`); slots are computed when read."""
        key = TokenKey.of(token_ids)
        return AppendResult(self._append([seq_id], [key.num_tokens], key.data), 0, block_start=0, slot_start=0)

    def append_many(self, requests: Sequence[tuple[int, TokenIds]]) -> list[AppendResult]:
        """Append to several sequences, all or none; per-sequence records (see `append_batch`)."""
        return self._append(*append_many_args(requests)).results()

    def append_batch(self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds) -> AppendBatch:
        """One decode step in columns: sequence i appends the next `num_token_ids[i]` of `token_ids`, all or none.
        Validated once for the batch and planned in columns (well under a microsecond a sequence); earlier tokens
        count as computed from now on (see `commit`)."""
        return self._append(seq_ids, *append_args(seq_ids, num_token_ids, token_ids))

    def _append(self, seq_ids: Sequence[int], counts: list[int], key: bytes) -> AppendBatch:
        """`append_batch` after its arguments are checked: `key` holds sum(counts) validated tokens."""
        return append(self._blocks, self._sequences, seq_ids, counts, key, self.limits.max_tokens_per_request)

    def can_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Would appending `num_tokens[i]` tokens to each `seq_ids[i]` (one `append_batch`) succeed? Counted as
        `append_batch` counts; False where it would raise OutOfBlocks or LimitExceeded (InvalidArgument or
        UnknownSequence where the query is malformed)."""
        counts = append_counts(seq_ids, num_tokens, "num_tokens")
        try:
            needed, drawn = self._blocks_to_append(seq_ids, counts)
        except LimitExceeded:
            return False
        return needed - drawn <= self._blocks.num_unreserved() and needed <= self._blocks.num_available()

    def check_append(
        self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds, num_blocks_taken: int = 0
    ) -> None:
        """Raise what `append_batch(...)` would raise once `num_blocks_taken` of the available blocks
        are gone (to opens applied before it). Changes nothing but the allocation-failure counter."""
        needed, drawn = self._blocks_to_append(seq_ids, append_args(seq_ids, num_token_ids, token_ids)[0])
        self._blocks.refuse_unless(needed - drawn, max(0, self._blocks.num_unreserved() - num_blocks_taken))

    def _blocks_to_append(self, seq_ids: Sequence[int], counts: list[int]) -> tuple[int, int]:
        """Blocks the append takes (new entries plus copies) and how many of them reservations cover."""
        reserved, limit = self._blocks.num_reserved > 0, self.limits.max_tokens_per_request
        plan = plan_batch(self._sequences, seq_ids, counts, self.block_size, limit, self.pool.ref_counts, reserved)
        return plan.num_blocks, plan.num_drawn

    def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Mark the K/V of the first `num_tokens[i]` tokens of `seq_ids[i]` as written, all or none.

        Only full blocks below this computed watermark are ever cached (see `radixkv.sequences.sequence`).
        Raises InvalidArgument (`num_tokens[i]` below the watermark or past the sequence's length)
        or UnknownSequence, and then nothing changes.
        """
        self._sequences.commit(seq_ids, num_tokens)

    def check_commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Raise what `commit` would raise for these arguments; changes nothing."""
        self._sequences.commit(seq_ids, num_tokens, apply=False)

    # -- fork, cache, release --------------------------------------------------------------------

    def fork(self, seq_id: int, num_children: int = 1) -> list[int]:
        """New sequences sharing every block of `seq_id` (parallel samples, beams); returns their ids.

        Publishes the parent's computed full blocks first; children inherit its watermark
        (see `radixkv.sequences.append`).
        """
        seq = check_fork(self._sequences, seq_id, num_children, self.limits.max_fork_children)
        children = fork(self.tree, self.pool, self._sequences, seq, num_children)
        self.stats_counters.num_forked_sequences += num_children
        return children

    def check_fork(self, seq_id: int, num_children: int) -> None:
        """Raise what `fork(seq_id, num_children)` would raise; changes nothing."""
        check_fork(self._sequences, seq_id, num_children, self.limits.max_fork_children)

    def cache(self, seq_id: int) -> int:
        """Insert the sequence's computed full blocks into the tree now, so the next turn hits;
        returns the tokens of the sequence the tree now holds for it."""
        seq = self._sequences.get(seq_id)
        publish(self.tree, self.pool, seq)
        return seq.num_tree_blocks * self.block_size

    def release(self, seq_id: int, cache: bool = True) -> None:
        """End a sequence; with `cache`, its full blocks stay in the tree for later requests."""
        self.release_many([seq_id], cache)

    def release_many(self, seq_ids: Iterable[int], cache: bool = True) -> None:
        """End several sequences, all or none."""
        live, parked = self._sequences.for_release(list(seq_ids))
        for seq in live:
            self._blocks.num_reserved -= seq.reservation()
            release(self.tree, self.pool, seq, cache)
            self._sequences.remove(seq)
        self.preemption.discard(parked)
        self.stats_counters.num_released_sequences += len(live) + len(parked)

    # -- memory pressure (see `radixkv.pressure`) -------------------------------------------------

    def preempt(self, seq_ids: Sequence[int], mode: str) -> PreemptResult:
        """Take the device blocks of live sequences back, all or none; each keeps its id and tokens.

        "recompute": publish its computed full blocks, drop its holds; "swap": move what only it holds
        to the host tier (FailedPrecondition without one). Its reservation returns either way.
        """
        with self._result_scope:
            return self.preemption.preempt(seq_ids, mode)

    def resume(self, seq_id: int) -> ResumeResult:
        """Bring a preempted sequence back under its id, re-reserving its growth; OutOfBlocks (and nothing
        changes) when it does not fit. After recompute, compute K/V for the returned slots."""
        with self._result_scope:
            return self.preemption.resume(seq_id)

    def evict(self, num_blocks: int, owner: str | None = None) -> int:
        """Free up to `num_blocks` unlocked cached blocks now, LRU first; returns how many. Allocation
        evicts by itself: this is for a caller that wants free blocks ahead of time, or that keeps a
        tenant's cache within its share (`owner`: only from its namespaces, `radixkv.tree.radix_tree.owner_of`)."""
        return self._blocks.evict_checked(num_blocks, owner)

    def num_available_blocks(self) -> int:
        """Free now, or free after evicting every unlocked cached block."""
        return self._blocks.num_available()

    def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        """How much `num_available_blocks()` would grow if `seq_ids` were released together, with or
        without `cache` (see `radixkv.pressure.scheduling`). Changes nothing."""
        return freeable_blocks(self.pool.ref_counts, self._sequences.batch(list(seq_ids)))

    def victims(self, num_blocks: int, among: Sequence[int] | None = None) -> list[int]:
        """Live sequences to preempt to give `num_blocks` back: lowest priority, then latest arrival, first
        (see `radixkv.pressure.scheduling.victims`); only from `among` when given (a session's own)."""
        candidates = list(self._sequences) if among is None else self._sequences.batch(list(among))
        return victims(self.pool.ref_counts, candidates, num_blocks)

    # -- probes and pins -------------------------------------------------------------------------

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
        num_host = self.host.match(match, key.data, key.num_tokens)[2]
        return match.num_blocks * self.block_size, num_host * self.block_size

    def pin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Keep the cached prefix of `token_ids` resident however cold it gets; returns tokens pinned.

        Pinned blocks may take at most `limits.max_pinned_fraction` of the pool.
        """
        key = self._key(token_ids, "token_ids")
        root = existing_root(self.tree, namespace)
        max_pinned = int(self.limits.max_pinned_fraction * self.pool.num_blocks)
        return self._pins.pin(root, key, namespace, max_pinned, self._blocks.num_unreserved())

    def unpin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Drop one pin taken by `pin` with the same tokens (in whole blocks)."""
        self._pins.unpin(self._key(token_ids, "token_ids"), namespace)

    def retain(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, retention: Retention = NO_RETENTION
    ) -> int:
        """A soft hint on the cached prefix of `token_ids` (TTL, priority, end of session: `radixkv.tree.eviction`);
        returns the tokens it covers. `expire()` evicts what a TTL let go, at once."""
        root = existing_root(self.tree, namespace)
        return retain(self._blocks, root, self._key(token_ids, "token_ids"), retention) if root is not None else 0

    def expire(self) -> int:
        return expire(self._blocks)

    # -- introspection ---------------------------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table; empty while it is preempted (it holds nothing on the device)."""
        return [] if self.is_preempted(seq_id) else self._sequences.get(seq_id).block_table.tolist()

    def num_table_blocks(self, seq_id: int) -> int:
        """`len(block_table(seq_id))` without building the list: 0 while preempted."""
        return 0 if self.is_preempted(seq_id) else self._sequences.get(seq_id).block_table.length

    def num_tokens(self, seq_id: int) -> int:
        record = self._sequences.preempted.get(seq_id)
        return record.num_tokens if record is not None else self._sequences.get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """The computed watermark: leading tokens whose K/V is written (see `commit`); 0 while preempted."""
        return 0 if self.is_preempted(seq_id) else self._sequences.get(seq_id).num_computed_tokens

    def reserve_until(self, seq_id: int) -> int:
        """The table length admission reserves growth up to (0: none), kept while preempted (see `Budget`)."""
        record = self._sequences.preempted.get(seq_id)
        return record.reserve_until if record is not None else self._sequences.get(seq_id).reserve_until

    def swap_blocks(self, seq_id: int) -> int:
        """Host-tier blocks the sequence holds swapped out, or that `preempt(..., "swap")` would move there now."""
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
        tree, pool = self.tree, self.pool
        return dataclasses.replace(
            self.stats_counters,
            num_blocks_free=pool.num_free,
            num_blocks_cached=tree.num_cached_blocks,
            num_blocks_evictable=tree.num_evictable_blocks,
            num_blocks_pinned=tree.num_pinned_blocks,
            num_blocks_in_use=pool.num_blocks - pool.num_free - tree.num_evictable_blocks,
            num_live_sequences=len(self._sequences),
            num_namespaces=len(tree.roots),
            num_blocks_reserved=self._blocks.num_reserved,
            num_preempted_sequences=len(self._sequences.preempted),
            **self.host.gauges(),  # all 0 for a tier of none, as the fields default
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
        if self.host.enabled:  # a tier of none holds nothing, and its recount would walk every node under the lock
            check_host_tier(self.host, swapped_host_blocks(sequences.preempted.values()))
