"""Sequences over a block pool and a radix tree: open, append, fork, cache, release, match, pin.

`KVCache` is the core's one public object, a facade over the modules that do each job (admission,
append, fork, publish, pins, scheduling, invariants). It tracks integers only: which blocks each
sequence's block table holds, which prefixes the tree caches, who holds what. Data never moves
here; when a write would land in a shared block, the caller gets a `(src_block, dst_block)` copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

from radixkv.admission import PlannedOpen, lock_prefix, open_planned, plan_open
from radixkv.allocation import Allocator
from radixkv.append import append, append_args, append_counts, append_many_args, plan_batch
from radixkv.block_pool import BlockPool
from radixkv.errors import LimitExceeded, RadixKVError
from radixkv.fork import check_fork, fork
from radixkv.host_tier import HostTier
from radixkv.invariants import check_holders
from radixkv.limits import Limits
from radixkv.namespaces import DEFAULT_NAMESPACE, existing_root, namespace_root
from radixkv.pins import Pins
from radixkv.publish import publish, release
from radixkv.radix_tree import Node, RadixTree
from radixkv.results import AppendBatch, AppendResult, OpenResult
from radixkv.scheduling import freeable_blocks
from radixkv.sequence import LiveSequence, Sequences
from radixkv.stats import Stats
from radixkv.token_ids import TokenIds, TokenKey

__all__ = ["DEFAULT_NAMESPACE", "KVCache", "Limits"]


class KVCache:
    """A paged KV cache with prefix sharing: the in-process core of radixkv.

    Who holds a block: the tree holds the blocks of its nodes (ref_count 1, always exactly: the
    tree never shares a block by count); a live sequence holds the blocks on its locked tree path
    through the lock (one walk of the path's nodes, whatever its length) and every other block of
    its table by ref_count. So a 128k-token hit costs a lock walk, not 8k increments, and an
    unlocked cached block is always reclaimable. Every error leaves every count as it was.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        limits: Limits | None = None,
        *,
        first_seq_id: int = 1,
        tree: RadixTree | None = None,
        host_num_blocks: int = 0,
    ) -> None:
        """`first_seq_id`: where sequence ids start; a server picks a fresh one per run so that an id
        from before a restart never names a sequence after it. `tree`: another eviction policy to compare.
        `host_num_blocks`: the host tier's size (`radixkv.host_tier`); 0: none, evicted prefixes are dropped."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.limits = limits or Limits()
        self.pool = BlockPool(num_blocks)
        self.tree = tree or RadixTree(block_size)
        self.stats_counters = Stats(num_blocks_total=num_blocks)
        self._sequences = Sequences(first_seq_id)
        self._pins = Pins(self.tree)
        self._blocks = Allocator(self.pool, self.tree, self.stats_counters)
        self.host = HostTier(host_num_blocks, self.tree, self.stats_counters) if host_num_blocks else None
        self._num_open_results = 0  # depth of `one_result` scopes

    def num_available_blocks(self) -> int:
        """Free now, or free after evicting every unlocked cached block."""
        return self._blocks.num_available()

    def evict(self, num_blocks: int, namespaces: Callable[[str], bool] | None = None) -> int:
        """Free up to `num_blocks` unlocked cached blocks now, LRU first; returns how many. Allocation
        evicts by itself: this is for a caller that wants free blocks ahead of time, or that keeps a
        tenant's cache within its share (`namespaces`: only from the namespaces it accepts)."""
        return self._blocks.evict_checked(num_blocks, namespaces)

    def _root(self, namespace: str, field: str = "namespace") -> Node:
        return namespace_root(self.tree, namespace, self.limits.max_namespaces, field)

    def _key(self, token_ids: TokenIds, field: str) -> TokenKey:
        return TokenKey.of(token_ids, field, max_tokens=self.limits.max_tokens_per_request)

    # -- open ------------------------------------------------------------------------------------

    def open(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> OpenResult:
        """Start a sequence: reuse the longest cached prefix, allocate blocks for the rest.

        A fully cached prompt still recomputes its last token (the model needs its logits), so the
        match stops one token short, in whole blocks. Raises InvalidArgument, LimitExceeded,
        OutOfBlocks, and then nothing changes.
        """
        return self.open_many([(token_ids, namespace)])[0]

    def _plan_open(self, requests: Sequence[tuple[TokenIds, str]]) -> tuple[list[PlannedOpen], int]:
        """Validate a batch of opens and check capacity before anything changes; also returns the
        blocks it takes from `num_available_blocks` (allocated plus newly locked)."""
        keys: list[tuple[TokenKey, Node]] = []
        for i, (token_ids, namespace) in enumerate(requests):
            prefix = f"requests[{i}]." if len(requests) > 1 else ""
            keys.append((self._key(token_ids, prefix + "token_ids"), self._root(namespace, prefix + "namespace")))
        planned, needed, newly_locked = plan_open(self.tree, keys)
        self._blocks.refuse_unless(needed, self.num_available_blocks() - newly_locked)
        return planned, needed + newly_locked

    def open_many(self, requests: Sequence[tuple[TokenIds, str]]) -> list[OpenResult]:
        """Open several sequences, all or none (one scheduler step's admissions)."""
        try:
            planned, _ = self._plan_open(requests)
        except RadixKVError:
            self.tree.drop_empty_roots()  # namespaces this refused request created
            raise
        with self.one_result():
            return open_planned(self._blocks, self._sequences, planned, [namespace for _, namespace in requests])

    @contextlib.contextmanager
    def one_result(self) -> Iterator[None]:
        """Calls inside hand the worker one result: it applies all their offloads, then all their copies, then
        all their loads (a server step is one). Until the outermost scope ends, no host block a load reads is
        reused by an offload (see `radixkv.host_tier`); each call outside any scope is one result by itself."""
        self._num_open_results += 1
        try:
            yield
        finally:
            self._num_open_results -= 1
            if not self._num_open_results and self.host is not None:
                self.host.settle()

    # -- append ----------------------------------------------------------------------------------

    def append(self, seq_id: int, token_ids: TokenIds) -> AppendResult:
        """Reserve slots for new tokens; copy-on-write the last block if another sequence shares it.

        Also marks every earlier token's K/V as written (see `commit`); slots are computed when read.
        """
        key = TokenKey.of(token_ids)
        batch = self._append([seq_id], [key.num_tokens], key.data)
        return AppendResult(batch, 0, 0, 0)

    def append_many(self, requests: Sequence[tuple[int, TokenIds]]) -> list[AppendResult]:
        """Append to several sequences, all or none; per-sequence records (see `append_batch`)."""
        return self._append(*append_many_args(requests)).results()

    def append_batch(self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds) -> AppendBatch:
        """One decode step in columns: sequence i appends the next `num_token_ids[i]` of `token_ids`.

        All or none. Validation runs once for the batch and slots are computed only when read,
        so a step of hundreds of sequences costs a few microseconds each. Each sequence's earlier
        tokens count as computed from now on (see `commit`).
        """
        return self._append(seq_ids, *append_args(seq_ids, num_token_ids, token_ids))

    def can_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Would appending `num_tokens[i]` tokens to each `seq_ids[i]` (one `append_batch`) succeed?

        Changes nothing. Counts new blocks, copy-on-write copies and what eviction could free exactly
        as `append_batch` does; False where it would raise OutOfBlocks or LimitExceeded. Raises
        InvalidArgument or UnknownSequence where the query itself is malformed.
        """
        counts = append_counts(seq_ids, num_tokens, "num_tokens")
        sequences = self._sequences.batch(seq_ids)
        try:
            return self._num_blocks_to_append(sequences, counts) <= self.num_available_blocks()
        except LimitExceeded:
            return False

    def _num_blocks_to_append(self, sequences: list[LiveSequence], counts: list[int]) -> int:
        """New blocks plus copies (see `radixkv.append.plan_append`); changes nothing."""
        plans = plan_batch(sequences, counts, self.block_size, self.limits.max_tokens_per_request, self.pool.ref_counts)
        return sum(n for n, _ in plans)

    def _append(self, seq_ids: Sequence[int], counts: list[int], key: bytes) -> AppendBatch:
        """`append_batch` after its arguments are checked: `key` holds sum(counts) validated tokens."""
        return append(self._blocks, self._sequences, seq_ids, counts, key, self.limits.max_tokens_per_request)

    def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Mark the K/V of the first `num_tokens[i]` tokens of `seq_ids[i]` as written, all or none.

        Only full blocks below this computed watermark are ever cached (see `radixkv.sequence`).
        Raises InvalidArgument (`num_tokens[i]` below the watermark or past the sequence's length)
        or UnknownSequence, and then nothing changes.
        """
        for seq, n in zip(self._sequences.for_commit(seq_ids, num_tokens), num_tokens, strict=True):
            seq.num_computed_tokens = int(n)

    def check_commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Raise what `commit` would raise for these arguments; changes nothing."""
        self._sequences.for_commit(seq_ids, num_tokens)

    def fork(self, seq_id: int, num_children: int = 1) -> list[int]:
        """New sequences sharing every block of `seq_id` (parallel samples, beams); returns their ids.

        Publishes the parent's computed full blocks first; children inherit its watermark (see `radixkv.fork`).
        """
        seq = check_fork(self._sequences, seq_id, num_children, self.limits.max_fork_children)
        children = fork(self.tree, self.pool, self._sequences, seq, num_children)
        self.stats_counters.num_forked_sequences += num_children
        return children

    # -- fork, cache, release --------------------------------------------------------------------

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
        for seq in self._sequences.batch(list(seq_ids)):
            release(self.tree, self.pool, seq, cache)
            self._sequences.remove(seq)
            self.stats_counters.num_released_sequences += 1

    def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        """How much `num_available_blocks()` would grow if `seq_ids` were released together, with or
        without `cache` (see `radixkv.scheduling`). Changes nothing."""
        return freeable_blocks(self.pool.ref_counts, self._sequences.batch(list(seq_ids)))

    # -- probes and pins -------------------------------------------------------------------------

    def lock_prefix(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> OpenResult:
        """Lock the cached prefix of `token_ids` (whole blocks) without allocating anything.

        Returns a sequence holding just that prefix: `num_cached_tokens` tokens, all computed, its
        `block_table` the cached blocks, no slots. It keeps them from eviction until `release`,
        and may be appended to like any sequence. Unlike `open`, the match may cover every token:
        pass `token_ids[:-1]` to keep the last token for the model. A miss gives an empty sequence.
        """
        key = self._key(token_ids, "token_ids")
        opened = lock_prefix(self.tree, self._sequences, self._root(namespace), key, namespace)
        self.stats_counters.num_opened_sequences += 1
        return opened

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

    def pin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Keep the cached prefix of `token_ids` resident however cold it gets; returns tokens pinned.

        Pinned blocks may take at most `limits.max_pinned_fraction` of the pool.
        """
        key = self._key(token_ids, "token_ids")
        root = existing_root(self.tree, namespace)
        return self._pins.pin(root, key, namespace, int(self.limits.max_pinned_fraction * self.pool.num_blocks))

    def unpin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Drop one pin taken by `pin` with the same tokens (in whole blocks)."""
        key = self._key(token_ids, "token_ids")
        self._pins.unpin(key, namespace)

    # -- dry runs: a multi-operation step checks every item before it applies any ----------------

    def check_open(self, requests: Sequence[tuple[TokenIds, str]]) -> int:
        """Raise what `open_many(requests)` would raise, else return the blocks it would take
        from `num_available_blocks` (allocated plus newly locked). Changes nothing but the
        allocation-failure counter, as the refused `open_many` would."""
        try:
            return self._plan_open(requests)[1]
        finally:
            self.tree.drop_empty_roots()  # namespaces the dry run created

    def check_append(
        self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds, num_blocks_taken: int = 0
    ) -> None:
        """Raise what `append_batch(...)` would raise once `num_blocks_taken` of the available blocks
        are gone (to opens applied before it). Changes nothing but the allocation-failure counter."""
        counts, _ = append_args(seq_ids, num_token_ids, token_ids)
        needed = self._num_blocks_to_append(self._sequences.batch(seq_ids), counts)
        self._blocks.refuse_unless(needed, self.num_available_blocks() - num_blocks_taken)

    def check_fork(self, seq_id: int, num_children: int) -> None:
        """Raise what `fork(seq_id, num_children)` would raise; changes nothing."""
        check_fork(self._sequences, seq_id, num_children, self.limits.max_fork_children)

    # -- introspection ---------------------------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._sequences.get(seq_id).block_table)

    def num_tokens(self, seq_id: int) -> int:
        return self._sequences.get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """The computed watermark: leading tokens whose K/V is written (see `commit`)."""
        return self._sequences.get(seq_id).num_computed_tokens

    def sequence_ids(self) -> list[int]:
        return self._sequences.ids()

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
            **(self.host.gauges() if self.host is not None else {}),
        )

    def check_invariants(self) -> None:
        """Recount everything from scratch and compare; raises AssertionError naming what broke."""
        check_holders(self.pool, self.tree, self._sequences, self._pins.holders())
        if self.host is not None:
            self.host.check_invariants([])
