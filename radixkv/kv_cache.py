"""Sequences over a block pool and a radix tree: open, append, fork, cache, release, preempt, resume, pin.

`KVCache` is the core's one public object, a facade over the modules that do each job (admission,
budget, append, fork, publish, preemption, pins, scheduling, invariants); its read-only half (probes,
dry runs, introspection) is `CacheQueries`. It tracks integers only: which blocks each sequence's
block table holds, which prefixes the tree caches, who holds what. Data never moves here; when a
write would land in a shared block, the caller gets a `(src_block, dst_block)` copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import TracebackType

from radixkv.cache_queries import CacheQueries
from radixkv.errors import RadixKVError
from radixkv.memory.block_pool import BlockPool
from radixkv.pressure.budget import Budget, reservation
from radixkv.pressure.limits import Limits
from radixkv.pressure.preemption import Preemption, PreemptResult, ResumeResult
from radixkv.pressure.swap import HostSwap
from radixkv.sequences.admission import count_opens, lock_prefix, open_planned
from radixkv.sequences.allocation import Allocator
from radixkv.sequences.append import append, append_args, append_many_args
from radixkv.sequences.fork import check_fork, fork
from radixkv.sequences.publish import publish, release
from radixkv.sequences.results import AppendBatch, AppendResult, OpenResult
from radixkv.sequences.sequence import Sequences
from radixkv.stats import Stats
from radixkv.tree.host_tier import HostTier
from radixkv.tree.namespaces import DEFAULT_NAMESPACE, existing_root
from radixkv.tree.pins import Pins
from radixkv.tree.radix_tree import RadixTree
from radixkv.tree.token_ids import TokenIds, TokenKey

__all__ = ["DEFAULT_NAMESPACE", "KVCache", "Limits"]


class KVCache(CacheQueries):
    """A paged KV cache with prefix sharing: the in-process core of radixkv.

    Who holds a block: the tree holds the blocks of its nodes (ref_count 1, always exactly: the
    tree never shares a block by count); a live sequence holds the blocks on its locked tree path
    through the lock (one walk of the path's nodes, whatever its length) and every other block of
    its table by ref_count. So a 128k-token hit costs a lock walk, not 8k increments, and an
    unlocked cached block is always reclaimable. Every error leaves every count as it was.
    Admission's reserved growth is a count no one else may allocate from (`radixkv.pressure.budget`).
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
    ) -> None:
        """`reserve_fraction`: share of a request's stated growth reserved at admission; `watermark_fraction`:
        of the pool kept from budgeted admissions (see `radixkv.pressure.budget`). `first_seq_id`: where sequence ids
        start; a server picks a fresh one per run so that an id from before a restart never names a sequence
        after it. `tree`: another eviction policy to compare. `host_num_blocks`: the host tier's size
        (`radixkv.tree.host_tier`); 0: none, and evicted prefixes are dropped."""
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
        self.budget = Budget.of(num_blocks, reserve_fraction, watermark_fraction)
        self.preemption = Preemption(self._blocks, self._sequences, self._root)  # `swap_tier`: the host tier
        self.host = HostTier(host_num_blocks, self.tree, self.stats_counters) if host_num_blocks else None
        if self.host is not None:
            self.preemption.swap_tier = HostSwap(self._blocks, self.host, self._root)
        self._num_open_results = 0  # depth of `one_result` scopes
        self._result_scope = _ResultScope(self)

    def evict(self, num_blocks: int, namespaces: Callable[[str], bool] | None = None) -> int:
        """Free up to `num_blocks` unlocked cached blocks now, LRU first; returns how many. Allocation
        evicts by itself: this is for a caller that wants free blocks ahead of time, or that keeps a
        tenant's cache within its share (`namespaces`: only from the namespaces it accepts)."""
        return self._blocks.evict_checked(num_blocks, namespaces)

    # -- open ------------------------------------------------------------------------------------

    def open(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, *, max_new_tokens: int = 0, priority: int = 0
    ) -> OpenResult:
        """Start a sequence: reuse the longest cached prefix, allocate blocks for the rest.

        A fully cached prompt still recomputes its last token (the model needs its logits), so the
        match stops one token short, in whole blocks. With `max_new_tokens`, admission by token budget
        (`radixkv.pressure.budget`): its growth is reserved, or NotAdmitted. Raises InvalidArgument,
        LimitExceeded, OutOfBlocks, NotAdmitted, and then nothing changes.
        """
        budgets, ranks = [max_new_tokens] if max_new_tokens else None, [priority] if priority else None  # None: all 0
        return self.open_many([(token_ids, namespace)], max_new_tokens=budgets, priorities=ranks)[0]

    def open_many(
        self, requests: Sequence[tuple[TokenIds, str]], *, max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[OpenResult]:  # fmt: skip
        """Open several sequences, all or none (one scheduler step's admissions); `max_new_tokens[i]` and
        `priorities[i]` as `open` takes them (None: all 0)."""
        try:
            planned, ranks, _ = self._plan_open(requests, max_new_tokens, priorities)
        except RadixKVError:
            self.tree.drop_empty_roots()  # namespaces this refused request created
            raise
        with self.one_result():
            opened = open_planned(self._blocks, self._sequences, planned, [ns for _, ns in requests], ranks)
        count_opens(self.stats_counters, planned, opened)
        return opened

    def one_result(self) -> _ResultScope:
        """`with cache.one_result():` calls inside hand the worker one result: it applies all their offloads, then
        all their copies, then all their loads (a server step is one). Until the outermost scope ends, no host
        block a load reads is reused by an offload (see `radixkv.tree.host_tier`); each call outside any scope is one
        result by itself."""
        return self._result_scope

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

    def _append(self, seq_ids: Sequence[int], counts: list[int], key: bytes) -> AppendBatch:
        """`append_batch` after its arguments are checked: `key` holds sum(counts) validated tokens."""
        return append(self._blocks, self._sequences, seq_ids, counts, key, self.limits.max_tokens_per_request)

    def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Mark the K/V of the first `num_tokens[i]` tokens of `seq_ids[i]` as written, all or none.

        Only full blocks below this computed watermark are ever cached (see `radixkv.sequences.sequence`).
        Raises InvalidArgument (`num_tokens[i]` below the watermark or past the sequence's length)
        or UnknownSequence, and then nothing changes.
        """
        for seq, n in zip(self._sequences.for_commit(seq_ids, num_tokens), num_tokens, strict=True):
            seq.num_computed_tokens = int(n)

    def fork(self, seq_id: int, num_children: int = 1) -> list[int]:
        """New sequences sharing every block of `seq_id` (parallel samples, beams); returns their ids.

        Publishes the parent's computed full blocks first; children inherit its watermark
        (see `radixkv.sequences.fork`).
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
        live, parked = self._sequences.for_release(list(seq_ids))
        for seq in live:
            self._blocks.num_reserved -= reservation(seq)
            release(self.tree, self.pool, seq, cache)
            self._sequences.remove(seq)
        self.preemption.discard(parked)
        self.stats_counters.num_released_sequences += len(live) + len(parked)

    # -- preemption (see `radixkv.pressure.preemption`) ---------------------------------------------------

    def preempt(self, seq_ids: Sequence[int], mode: str) -> PreemptResult:
        """Take the device blocks of live sequences back, all or none; each keeps its id and tokens.

        "recompute": publish its computed full blocks, drop its holds; "swap": move what only it holds
        to the host tier (FailedPrecondition without one). Its reservation returns either way.
        """
        with self.one_result():
            return self.preemption.preempt(seq_ids, mode)

    def resume(self, seq_id: int) -> ResumeResult:
        """Bring a preempted sequence back under its id, re-reserving its growth; OutOfBlocks (and nothing
        changes) when it does not fit. After recompute, compute K/V for the returned slots."""
        with self.one_result():
            return self.preemption.resume(seq_id)

    # -- probes and pins -------------------------------------------------------------------------

    def lock_prefix(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> OpenResult:
        """Lock the cached prefix of `token_ids` (whole blocks) without allocating anything.

        Returns a sequence holding just that prefix: `num_cached_tokens` tokens, all computed, its
        `block_table` the cached blocks, no slots. It keeps them from eviction until `release`,
        and may be appended to like any sequence. Unlike `open`, the match may cover every token:
        pass `token_ids[:-1]` to keep the last token for the model. A miss gives an empty sequence.
        """
        key = self._key(token_ids, "token_ids")
        try:
            opened = lock_prefix(self._blocks, self._sequences, self._root(namespace), key, namespace)
        except RadixKVError:
            self.tree.drop_empty_roots()
            raise
        self.stats_counters.num_opened_sequences += 1
        return opened

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
        key = self._key(token_ids, "token_ids")
        self._pins.unpin(key, namespace)


class _ResultScope:
    """`KVCache.one_result()`'s scope: a class, not a generator, as a server step enters one each time."""

    __slots__ = ("_cache",)

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    def __enter__(self) -> None:
        self._cache._num_open_results += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        cache = self._cache
        cache._num_open_results -= 1
        if not cache._num_open_results and cache.host is not None:
            cache.host.settle()
