"""Sequences over a block pool and a radix tree: open, append, fork, cache, release, match, pin.

`KVCache` is the whole core in one object. It tracks integers only: which blocks each sequence's
block table holds, which prefixes the tree caches, who holds what. Data never moves here; when a
write would land in a shared block, the caller gets a `(src_block, dst_block)` copy to apply first.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

import numpy as np

from radixkv.append import append_args, append_counts, apply_batch, plan_batch
from radixkv.block_pool import BlockPool, cdiv
from radixkv.errors import InvalidArgument, LimitExceeded, OutOfBlocks, RadixKVError
from radixkv.invariants import check_holders
from radixkv.pins import Pins
from radixkv.radix_tree import Match, Node, RadixTree
from radixkv.results import AppendBatch, AppendResult, OpenResult, SlotPlan
from radixkv.scheduling import freeable_blocks
from radixkv.sequence import LiveSequence, Sequences, check_watermarks, path_blocks
from radixkv.stats import Stats
from radixkv.token_ids import TokenIds, TokenKey

DEFAULT_NAMESPACE = "default"
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:/@=+-]{1,128}")


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Caps that keep one caller from taking the pool. Refused with `LimitExceeded` naming the cap."""

    max_tokens_per_request: int = 1 << 20
    max_fork_children: int = 1024
    max_namespaces: int = 4096
    max_pinned_fraction: float = 0.25


class KVCache:
    """A paged KV cache with prefix sharing: the in-process core of radixkv.

    Who holds a block: the tree holds the blocks of its nodes (ref_count 1, always exactly: the
    tree never shares a block by count); a live sequence holds the blocks on its locked tree path
    through the lock (one walk of the path's nodes, whatever its length) and every other block of
    its table by ref_count. So a 128k-token hit costs a lock walk, not 8k increments, and an
    unlocked cached block is always reclaimable. Every error leaves every count as it was.
    """

    def __init__(self, num_blocks: int, block_size: int, limits: Limits | None = None, *, first_seq_id: int = 1) -> None:
        """`first_seq_id`: where sequence ids start; a server picks a fresh one per run so that an id
        from before a restart never names a sequence after it."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.limits = limits or Limits()
        self.pool = BlockPool(num_blocks)
        self.tree = RadixTree(block_size)
        self.stats_counters = Stats(num_blocks_total=num_blocks)
        self._sequences = Sequences(first_seq_id)
        self._pins = Pins(self.tree)

    # -- sizing ----------------------------------------------------------------------------------

    def num_available_blocks(self) -> int:
        """Free now, or free after evicting every unlocked cached block."""
        return self.pool.num_free + self.tree.num_evictable_blocks

    def _allocate(self, n: int) -> list[int]:
        if n > self.num_available_blocks():
            self.stats_counters.num_allocation_failures += 1
            raise OutOfBlocks(n, self.num_available_blocks())
        shortfall = n - self.pool.num_free
        if shortfall > 0:
            self._evict(shortfall)
        return self.pool.allocate(n)

    def _evict(self, num_blocks: int) -> int:
        evicted = self.tree.evict(num_blocks)
        self.stats_counters.num_evicted_blocks += len(evicted)
        self.pool.free_exclusive(evicted)  # the tree was their only holder
        return len(evicted)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` unlocked cached blocks now, least recently used first; returns how many.

        Allocation evicts by itself when it runs short: this is for a caller that wants free blocks
        ahead of time (an integration mirroring another engine's `evict`).
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise InvalidArgument("num_blocks", f"must be a non-negative integer, got {num_blocks!r}")
        return self._evict(num_blocks) if num_blocks else 0

    def _blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _root(self, namespace: str, field: str = "namespace") -> Node:
        root = self.tree.roots.get(namespace)
        if root is not None:
            return root
        _check_namespace(namespace, field)
        if len(self.tree.roots) >= self.limits.max_namespaces:
            raise LimitExceeded("max_namespaces", len(self.tree.roots) + 1, self.limits.max_namespaces)
        return self.tree.root(namespace)

    def _key(self, token_ids: TokenIds, field: str) -> TokenKey:
        key = TokenKey.of(token_ids, field)
        if key.num_tokens > self.limits.max_tokens_per_request:
            raise LimitExceeded("max_tokens_per_request", key.num_tokens, self.limits.max_tokens_per_request)
        return key

    # -- open ------------------------------------------------------------------------------------

    def open(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> OpenResult:
        """Start a sequence: reuse the longest cached prefix, allocate blocks for the rest.

        A fully cached prompt still recomputes its last token (the model needs its logits), so the
        match stops one token short, in whole blocks.

        Raises:
            InvalidArgument, LimitExceeded, OutOfBlocks: nothing changes.
        """
        return self.open_many([(token_ids, namespace)])[0]

    def _plan_open(self, requests: Sequence[tuple[TokenIds, str]]) -> tuple[list[tuple[TokenKey, Node, Match]], int]:
        """Validate a batch of opens and check capacity before anything changes; also returns the blocks it takes.

        Blocks needed must fit in free blocks plus what stays evictable once every matched path is
        locked; opening takes exactly that many (needed + newly locked) from `num_available_blocks`.
        """
        keys: list[tuple[TokenKey, Node]] = []
        for i, (token_ids, namespace) in enumerate(requests):
            prefix = f"requests[{i}]." if len(requests) > 1 else ""
            keys.append((self._key(token_ids, prefix + "token_ids"), self._root(namespace, prefix + "namespace")))
        needed = 0
        newly_locked: dict[int, int] = {}
        planned: list[tuple[TokenKey, Node, Match]] = []
        for key, root in keys:
            num_tokens = key.num_tokens
            match = self.tree.match(root, key.data, (num_tokens - 1) // self.block_size)
            planned.append((key, root, match))
            needed += self._blocks_for(num_tokens) - match.num_blocks
            for node in match.path:
                if node.lock_ref == 0:
                    in_node = match.num_blocks_in_node if node is match.node else len(node.block_ids)
                    newly_locked[node.node_id] = max(newly_locked.get(node.node_id, 0), in_node)
        available = self.num_available_blocks() - sum(newly_locked.values())
        if needed > available:
            self.stats_counters.num_allocation_failures += 1
            raise OutOfBlocks(needed, available)
        return planned, needed + sum(newly_locked.values())

    def open_many(self, requests: Sequence[tuple[TokenIds, str]]) -> list[OpenResult]:
        """Open several sequences, all or none (one scheduler step's admissions)."""
        try:
            keys, _ = self._plan_open(requests)
        except RadixKVError:
            self.tree.drop_empty_roots()  # namespaces this refused request created
            raise
        # Lock every matched prefix first, so one request's allocation cannot evict another's hit.
        locked: list[tuple[TokenKey, Node, int]] = []
        for i, (key, root, match) in enumerate(keys):
            if i:  # an earlier item's split may have moved this item's match
                match = self.tree.match(root, key.data, (key.num_tokens - 1) // self.block_size)
            node = self.tree.split(match)
            self.tree.lock(node)
            locked.append((key, node, match.num_blocks))
        results = []
        for (key, node, num_matched_blocks), (_, namespace) in zip(locked, requests, strict=True):
            num_tokens, num_cached = key.num_tokens, num_matched_blocks * self.block_size
            table = path_blocks(node, num_matched_blocks)
            table += self._allocate(self._blocks_for(num_tokens) - num_matched_blocks)
            tail = bytearray(key.tail_after(num_cached))
            seq = LiveSequence(self._sequences.next_id(), namespace, tail, table, node, num_matched_blocks, [], num_tokens, num_cached)
            self._sequences.add(seq)
            self.stats_counters.num_requested_tokens += num_tokens
            self.stats_counters.num_hit_tokens += num_cached
            self.stats_counters.num_opened_sequences += 1
            first = num_matched_blocks  # the uncached tokens start on a block boundary
            slots = SlotPlan(self.block_size, table[first:], [0], [num_tokens - num_cached])
            results.append(OpenResult(seq.seq_id, num_cached, list(table), slots))
        return results

    # -- append ----------------------------------------------------------------------------------

    def append(self, seq_id: int, token_ids: TokenIds) -> AppendResult:
        """Reserve slots for new tokens; copy-on-write the last block if another sequence shares it.

        Appending also says the K/V of every earlier token is written (see `commit`). Slots are
        computed when first read, as for `append_batch`.
        """
        key = TokenKey.of(token_ids)
        batch = self._append([seq_id], [key.num_tokens], key.data)
        return AppendResult(batch, 0, 0, 0)

    def append_many(self, requests: Sequence[tuple[int, TokenIds]]) -> list[AppendResult]:
        """Append to several sequences, all or none; per-sequence records (see `append_batch`)."""
        keys = [TokenKey.of(t, f"requests[{i}].token_ids" if len(requests) > 1 else "token_ids") for i, (_, t) in enumerate(requests)]
        counts = [k.num_tokens for k in keys]
        return self._append([seq_id for seq_id, _ in requests], counts, b"".join(k.data for k in keys)).results()

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
        as `append_batch` does; False where it would raise OutOfBlocks or LimitExceeded.

        Raises:
            InvalidArgument, UnknownSequence: the query itself is malformed.
        """
        counts = append_counts(seq_ids, num_tokens, "num_tokens")
        sequences = self._sequences.batch(seq_ids)
        try:
            plans = self._plan_append(sequences, counts)
        except LimitExceeded:
            return False
        return sum(n for n, _ in plans) <= self.num_available_blocks()

    def _plan_append(self, sequences: list[LiveSequence], counts: list[int]) -> list[tuple[int, int | None]]:
        """Per sequence: (num_new_blocks, cow_src); changes nothing (see `radixkv.append.plan_append`)."""
        return plan_batch(sequences, counts, self.block_size, self.limits.max_tokens_per_request, self.pool.ref_counts)

    def _append(self, seq_ids: Sequence[int], counts: list[int], key: bytes) -> AppendBatch:
        """`append_batch` after its arguments are checked: `key` holds sum(counts) validated tokens."""
        sequences = self._sequences.batch(seq_ids)
        plans = self._plan_append(sequences, counts)
        new_blocks = self._allocate(sum(n for n, _ in plans))
        batch = apply_batch(seq_ids, sequences, counts, plans, new_blocks, key, self.pool, self.block_size)
        self.stats_counters.num_cow_copies += len(batch.copies)
        return batch

    def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Mark the K/V of the first `num_tokens[i]` tokens of `seq_ids[i]` as written, all or none.

        Only full blocks below this watermark are ever cached (by `cache`, `release(cache=True)`
        and `fork`), so a later request never hits K/V the worker has not written. `append` implies
        it for the tokens before the appended ones; call `commit` for the rest (after a prefill,
        before caching, forking or releasing a sequence whose last tokens are written).

        Raises:
            InvalidArgument: `num_tokens[i]` below the watermark or past the sequence's length.
            UnknownSequence: nothing changes.
        """
        for seq, n in zip(self._check_commit(seq_ids, num_tokens), num_tokens, strict=True):
            seq.num_computed_tokens = int(n)

    def check_commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Raise what `commit` would raise for these arguments; changes nothing."""
        self._check_commit(seq_ids, num_tokens)

    def _check_commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[LiveSequence]:
        if len(num_tokens) != len(seq_ids):
            raise InvalidArgument("num_tokens", f"needs one entry per seq_ids entry ({len(seq_ids)}), got {len(num_tokens)}")
        sequences = self._sequences.batch(seq_ids)
        check_watermarks(sequences, num_tokens)
        return sequences

    # -- fork ------------------------------------------------------------------------------------

    def fork(self, seq_id: int, num_children: int = 1) -> list[int]:
        """New sequences sharing every block of `seq_id` (parallel samples, beams); returns their ids.

        The parent's computed full blocks enter the tree first (fork after committing the parent's
        K/V, as samplers do), so the family shares them through the locked path. Any other block
        the family shares is held by count: full blocks not yet computed (no one appends into a
        full block, and none is cached while another holder shares it) and the partial last block,
        which no one writes while it is shared (a write copies it). Children inherit the parent's
        computed watermark.
        """
        seq = self._check_fork(seq_id, num_children)
        self._cache(seq)
        self.pool.incref(seq.private_blocks(), by=num_children)
        self.tree.lock(seq.lock_node, num_children)
        children = []
        for _ in range(num_children):
            child = LiveSequence(
                self._sequences.next_id(), seq.namespace, bytearray(seq.tail_bytes), list(seq.block_table), seq.lock_node, seq.num_tree_blocks,
                list(seq.private_prefix), seq.num_tokens, seq.num_computed_tokens,
            )
            self._sequences.add(child)
            children.append(child.seq_id)
        self.stats_counters.num_forked_sequences += num_children
        return children

    def _check_fork(self, seq_id: int, num_children: int) -> LiveSequence:
        seq = self._sequences.get(seq_id)
        if not isinstance(num_children, int) or isinstance(num_children, bool) or num_children < 1:
            raise InvalidArgument("num_children", f"must be a positive integer, got {num_children!r}")
        if num_children > self.limits.max_fork_children:
            raise LimitExceeded("max_fork_children", num_children, self.limits.max_fork_children)
        return seq

    # -- cache / release -------------------------------------------------------------------------

    def cache(self, seq_id: int) -> int:
        """Insert the sequence's computed full blocks into the tree now, so the next turn hits.

        Returns the tokens of the sequence the tree now holds for it.
        """
        seq = self._sequences.get(seq_id)
        self._cache(seq)
        return seq.num_tree_blocks * self.block_size

    def _cache(self, seq: LiveSequence) -> None:
        """Publish the full blocks below the computed watermark, stopping at a block another sequence
        of the fork family still holds by count (the tree's blocks have exactly one holder)."""
        num_full = min(seq.num_tokens, seq.num_computed_tokens) // self.block_size
        if num_full <= seq.num_tree_blocks:
            return
        bb = TokenKey.num_bytes(self.block_size)
        new_blocks = seq.block_table[seq.num_tree_blocks : num_full]
        key = bytes(seq.tail_bytes[: len(new_blocks) * bb])
        counts = self.pool.ref_counts[np.asarray(new_blocks, dtype=np.intp)]
        if counts.max() > 1:
            num_known = self.tree.match(seq.lock_node, key).num_blocks  # the tree keeps its own blocks for these
            held_by_others = np.flatnonzero(counts[num_known:] > 1)
            shared = num_known + int(held_by_others[0]) if held_by_others.size else len(new_blocks)
            if shared == 0:
                return
            new_blocks, key = new_blocks[:shared], key[: shared * bb]
            num_full = seq.num_tree_blocks + shared
        node, num_taken = self.tree.insert(seq.lock_node, key, new_blocks)
        # The tree takes over this sequence's hold on the blocks it took (the lock now covers them);
        # where it already held the prefix, the sequence keeps its duplicates privately.
        seq.private_prefix += new_blocks[: len(new_blocks) - num_taken]
        self.tree.lock(node)
        self.tree.unlock(seq.lock_node)
        seq.lock_node, seq.num_tree_blocks = node, num_full
        del seq.tail_bytes[: len(key)]

    def release(self, seq_id: int, cache: bool = True) -> None:
        """End a sequence; with `cache`, its full blocks stay in the tree for later requests."""
        self.release_many([seq_id], cache)

    def release_many(self, seq_ids: Iterable[int], cache: bool = True) -> None:
        """End several sequences, all or none."""
        for seq in self._sequences.batch(list(seq_ids)):
            if cache:
                self._cache(seq)
            self.tree.unlock(seq.lock_node)
            self.pool.decref(seq.private_blocks())
            self._sequences.remove(seq)
            self.stats_counters.num_released_sequences += 1

    def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        """How much `num_available_blocks()` would grow if `seq_ids` were released together.

        The same for `cache=True` and `cache=False`: a block the release caches becomes evictable
        and one it does not cache becomes free, and both count as available. What the sequences
        share with others (blocks held by count, locked tree nodes) is counted only where they are
        its last holders. Changes nothing.
        """
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
        root = self._root(namespace)
        match = self.tree.match(root, key.data)
        node, num_blocks = self.tree.split(match), match.num_blocks
        self.tree.lock(node)
        table = path_blocks(node, num_blocks)
        num_cached = num_blocks * self.block_size
        seq = LiveSequence(self._sequences.next_id(), namespace, bytearray(), table, node, num_blocks, [], num_cached, num_cached)
        self._sequences.add(seq)
        self.stats_counters.num_opened_sequences += 1
        return OpenResult(seq.seq_id, num_cached, list(table), SlotPlan(self.block_size, [], [0], [0]))

    def match(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many leading tokens are cached (whole blocks); locks and refreshes nothing."""
        key = self._key(token_ids, "token_ids")
        root = self.tree.roots.get(namespace)
        if root is None:
            _check_namespace(namespace)
            return 0
        return self.tree.match(root, key.data).num_blocks * self.block_size

    def pin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Keep the cached prefix of `token_ids` resident however cold it gets; returns tokens pinned.

        Pinned blocks may take at most `limits.max_pinned_fraction` of the pool.
        """
        key = self._key(token_ids, "token_ids")
        root = self.tree.roots.get(namespace)
        if root is None:
            _check_namespace(namespace)
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

    def check_append(self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds, num_blocks_taken: int = 0) -> None:
        """Raise what `append_batch(...)` would raise once `num_blocks_taken` of the available blocks
        are gone (to opens applied before it). Changes nothing but the allocation-failure counter."""
        counts, _ = append_args(seq_ids, num_token_ids, token_ids)
        needed = sum(n for n, _ in self._plan_append(self._sequences.batch(seq_ids), counts))
        available = self.num_available_blocks() - num_blocks_taken
        if needed > available:
            self.stats_counters.num_allocation_failures += 1
            raise OutOfBlocks(needed, available)

    def check_fork(self, seq_id: int, num_children: int) -> None:
        """Raise what `fork(seq_id, num_children)` would raise; changes nothing."""
        self._check_fork(seq_id, num_children)

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
        )

    def check_invariants(self) -> None:
        """Recount everything from scratch and compare; raises AssertionError naming what broke."""
        check_holders(self.pool, self.tree, self._sequences, self._pins.holders())


def _check_namespace(namespace: str, field: str = "namespace") -> None:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidArgument(field, "must be 1-128 characters of A-Z a-z 0-9 _ . : / @ = + -")

