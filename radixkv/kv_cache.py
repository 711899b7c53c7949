"""Sequences over a block pool and a radix tree: open, append, fork, cache, release, match, pin.

`KVCache` is the whole core in one object. It tracks integers only: which blocks each sequence's
block table holds, which prefixes the tree caches, who holds what. Data never moves here; when a
write would land in a shared block, the caller gets a `(src_block, dst_block)` copy to apply first.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from radixkv.block_pool import BlockPool, cdiv
from radixkv.errors import (
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
    NotPinned,
    OutOfBlocks,
    RadixKVError,
    UnknownSequence,
)
from radixkv.radix_tree import Match, Node, RadixTree
from radixkv.results import AppendBatch, AppendResult, OpenResult, SlotPlan
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


@dataclasses.dataclass(slots=True, eq=False)
class _Sequence:
    seq_id: int
    namespace: str
    # Tokens past the locked path (int32 bytes): all a sequence must keep of its history, since the
    # tree holds the rest. After a fork (which caches first) that is less than one block per child.
    tail_bytes: bytearray
    block_table: list[int]
    lock_node: Node  # deepest tree node on this sequence's prefix that it keeps locked (root: none)
    num_tree_blocks: int  # leading blocks of the table that the locked path covers
    # Blocks this sequence holds by ref_count: the table past the locked path, plus its own copies of
    # locked-path blocks when the tree already held that prefix in other blocks (duplicates).
    private_prefix: list[int]
    num_tokens: int
    # Tokens whose K/V the worker has written (`commit`, or implied by the next `append`): only
    # full blocks below this watermark are ever published to the tree.
    num_computed_tokens: int

    def private_blocks(self) -> list[int]:
        return self.private_prefix + self.block_table[self.num_tree_blocks :]


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
        self._sequences: dict[int, _Sequence] = {}
        self._seq_ids = itertools.count(first_seq_id)
        self._pins: dict[tuple[str, bytes], tuple[Node, int]] = {}

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

    def _evict(self, num_blocks: int, namespaces: Callable[[str], bool] | None = None) -> int:
        evicted = self.tree.evict(num_blocks, namespaces)
        self.stats_counters.num_evicted_blocks += len(evicted)
        self.pool.free_exclusive(evicted)  # the tree was their only holder
        return len(evicted)

    def evict(self, num_blocks: int, namespaces: Callable[[str], bool] | None = None) -> int:
        """Free up to `num_blocks` unlocked cached blocks now, least recently used first; returns how many.

        Allocation evicts by itself when it runs short: this is for a caller that wants free blocks
        ahead of time (an integration mirroring another engine's `evict`), or that keeps a tenant's
        cache within its share (`namespaces`: only from the namespaces it accepts).
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise InvalidArgument("num_blocks", f"must be a non-negative integer, got {num_blocks!r}")
        return self._evict(num_blocks, namespaces) if num_blocks else 0

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

    def _batch_sequences(self, seq_ids: Sequence[int]) -> list[_Sequence]:
        """The live sequences of a batch, each once, or the error naming the first bad entry."""
        live = self._sequences
        found = [live.get(s) if isinstance(s, int) else None for s in seq_ids]
        for i, seq in enumerate(found):
            if seq is None:
                self._sequence(seq_ids[i], f"seq_ids[{i}]")  # raises
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument("seq_ids", "a sequence appears twice in one batch")
        return found  # type: ignore[return-value]  # no None is left

    def _sequence(self, seq_id: int, field: str = "seq_id") -> _Sequence:
        seq = self._sequences.get(seq_id) if isinstance(seq_id, int) else None
        if seq is None:
            if not isinstance(seq_id, int) or isinstance(seq_id, bool):
                raise InvalidArgument(field, f"must be an integer, got {type(seq_id).__name__}")
            raise UnknownSequence(seq_id)
        return seq

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
            table = self._path_blocks(node, num_matched_blocks)
            table += self._allocate(self._blocks_for(num_tokens) - num_matched_blocks)
            tail = bytearray(key.tail_after(num_cached))
            seq = _Sequence(next(self._seq_ids), namespace, tail, table, node, num_matched_blocks, [], num_tokens, num_cached)
            self._sequences[seq.seq_id] = seq
            self.stats_counters.num_requested_tokens += num_tokens
            self.stats_counters.num_hit_tokens += num_cached
            self.stats_counters.num_opened_sequences += 1
            first = num_matched_blocks  # the uncached tokens start on a block boundary
            slots = SlotPlan(self.block_size, table[first:], [0], [num_tokens - num_cached])
            results.append(OpenResult(seq.seq_id, num_cached, list(table), slots))
        return results

    @staticmethod
    def _path_blocks(node: Node, num_blocks: int) -> list[int]:
        runs = []
        while node.parent is not None:
            runs.append(node.block_ids)
            node = node.parent
        blocks: list[int] = []
        for run in reversed(runs):  # one C-level extend per node, never a Python step per block
            blocks += run
        assert len(blocks) == num_blocks, "locked path and match length disagree"
        return blocks

    # -- append ----------------------------------------------------------------------------------

    def append(self, seq_id: int, token_ids: TokenIds) -> AppendResult:
        """Reserve slots for new tokens; copy-on-write the last block if another sequence shares it.

        Appending also says the K/V of every earlier token is written (see `commit`). Slots are
        computed when first read, as for `append_batch`.
        """
        key = TokenKey.of(token_ids)
        batch = self._append_columns([seq_id], [key.num_tokens], key.data)
        return AppendResult(batch, 0, 0, 0)

    def append_many(self, requests: Sequence[tuple[int, TokenIds]]) -> list[AppendResult]:
        """Append to several sequences, all or none; per-sequence records (see `append_batch`)."""
        keys = [TokenKey.of(t, f"requests[{i}].token_ids" if len(requests) > 1 else "token_ids") for i, (_, t) in enumerate(requests)]
        counts = [k.num_tokens for k in keys]
        return self._append_columns([seq_id for seq_id, _ in requests], counts, b"".join(k.data for k in keys)).results()

    def append_batch(self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds) -> AppendBatch:
        """One decode step in columns: sequence i appends the next `num_token_ids[i]` of `token_ids`.

        All or none. Validation runs once for the batch and slots are computed only when read,
        so a step of hundreds of sequences costs a few microseconds each. Each sequence's earlier
        tokens count as computed from now on (see `commit`).
        """
        return self._append_columns(seq_ids, *self._append_args(seq_ids, num_token_ids, token_ids))

    @staticmethod
    def _append_args(seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds) -> tuple[list[int], bytes]:
        """`append_batch`'s arguments checked: (the counts as ints, the tokens packed)."""
        counts = KVCache._append_counts(seq_ids, num_token_ids, "num_token_ids")
        key = TokenKey.of(token_ids)
        if sum(counts) != key.num_tokens:
            raise InvalidArgument("token_ids", f"sum(num_token_ids) is {sum(counts)}, token_ids holds {key.num_tokens}")
        return counts, key.data

    @staticmethod
    def _append_counts(seq_ids: Sequence[int], num_token_ids: Sequence[int], field: str) -> list[int]:
        if len(num_token_ids) != len(seq_ids):
            raise InvalidArgument(field, f"needs one entry per seq_ids entry ({len(seq_ids)}), got {len(num_token_ids)}")
        counts = [int(n) for n in num_token_ids]
        if counts and min(counts) < 1:
            raise InvalidArgument(field, "every sequence appends at least one token")
        return counts

    def can_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Would appending `num_tokens[i]` tokens to each `seq_ids[i]` (one `append_batch`) succeed?

        Changes nothing. Counts new blocks, copy-on-write copies and what eviction could free exactly
        as `append_batch` does; False where it would raise OutOfBlocks or LimitExceeded.

        Raises:
            InvalidArgument, UnknownSequence: the query itself is malformed.
        """
        counts = self._append_counts(seq_ids, num_tokens, "num_tokens")
        sequences = self._batch_sequences(seq_ids)
        try:
            plans = self._plan_append(sequences, counts)
        except LimitExceeded:
            return False
        return sum(n for n, _ in plans) <= self.num_available_blocks()

    def _plan_append(self, sequences: list[_Sequence], counts: list[int]) -> list[tuple[int, bool]]:
        """Per sequence: how many blocks its append takes and whether it copies its last block first.

        The last holder of a shared partial block writes in place once the others have copied.
        Changes nothing; raises LimitExceeded for a sequence that would grow past the cap.
        """
        bs, limit, ref_counts = self.block_size, self.limits.max_tokens_per_request, self.pool.ref_counts
        copied_away: dict[int, int] = {}  # block -> holders in this batch that copy it before writing
        plans: list[tuple[int, bool]] = []
        for seq, count in zip(sequences, counts, strict=True):
            num_tokens = seq.num_tokens + count
            if num_tokens > limit:
                raise LimitExceeded("max_tokens_per_request", num_tokens, limit)
            table = seq.block_table
            cow = False
            if seq.num_tokens % bs:
                last = table[-1]
                if ref_counts[last] - copied_away.get(last, 0) > 1:
                    copied_away[last] = copied_away.get(last, 0) + 1
                    cow = True
            plans.append((cdiv(num_tokens, bs) - len(table) + cow, cow))
        return plans

    def _append_columns(self, seq_ids: Sequence[int], counts: list[int], key: bytes) -> AppendBatch:
        """`append_batch` after its arguments are checked: `key` holds sum(counts) validated tokens."""
        sequences = self._batch_sequences(seq_ids)
        plans = self._plan_append(sequences, counts)
        bs = self.block_size
        new_blocks = self._allocate(sum(n for n, _ in plans))
        view = memoryview(key)
        num_tokens_after, offsets, num_block_ids, block_ids, copies = [], [], [], [], []
        span_blocks: list[int] = []  # per sequence, the table blocks its new tokens land in
        span_starts: list[int] = []  # position of each sequence's first new token, relative to its span
        taken = byte = 0
        for i, (seq, count, (num_new, cow)) in enumerate(zip(sequences, counts, plans, strict=True)):
            table, start = seq.block_table, seq.num_tokens
            offset = len(table)
            if num_new:
                mine = new_blocks[taken : taken + num_new]
                taken += num_new
                if cow:
                    src, dst = table[-1], mine[0]
                    self.pool.decref([src])
                    table[-1] = dst
                    copies.append((src, dst, i))
                    offset -= 1
                    self.stats_counters.num_cow_copies += 1
                    table.extend(mine[1:])
                else:
                    table.extend(mine)
            seq.tail_bytes += view[byte : byte + TokenKey.num_bytes(count)]
            byte += TokenKey.num_bytes(count)
            seq.num_computed_tokens = max(seq.num_computed_tokens, start)  # the model has seen every earlier token
            seq.num_tokens = stop = start + count
            first = start // bs
            span_starts.append(len(span_blocks) * bs + start - first * bs)
            span_blocks.extend(table[first : cdiv(stop, bs)])
            num_tokens_after.append(stop)
            offsets.append(offset)
            num_block_ids.append(len(table) - offset)
            block_ids.extend(table[offset:])
        plan = SlotPlan(bs, span_blocks, span_starts, counts)
        return AppendBatch(list(seq_ids), counts, num_tokens_after, offsets, num_block_ids, block_ids, copies, plan)

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

    def _check_commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[_Sequence]:
        if len(num_tokens) != len(seq_ids):
            raise InvalidArgument("num_tokens", f"needs one entry per seq_ids entry ({len(seq_ids)}), got {len(num_tokens)}")
        sequences = self._batch_sequences(seq_ids)
        for i, (seq, n) in enumerate(zip(sequences, num_tokens, strict=True)):
            if not isinstance(n, int | np.integer) or isinstance(n, bool):
                raise InvalidArgument(f"num_tokens[{i}]", f"must be an integer, got {type(n).__name__}")
            if n < seq.num_computed_tokens:
                raise InvalidArgument(f"num_tokens[{i}]", f"{n} is below the {seq.num_computed_tokens} tokens already computed")
            if n > seq.num_tokens:
                raise InvalidArgument(f"num_tokens[{i}]", f"{n} is past the sequence's {seq.num_tokens} tokens")
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
            child = _Sequence(
                next(self._seq_ids), seq.namespace, bytearray(seq.tail_bytes), list(seq.block_table), seq.lock_node, seq.num_tree_blocks,
                list(seq.private_prefix), seq.num_tokens, seq.num_computed_tokens,
            )
            self._sequences[child.seq_id] = child
            children.append(child.seq_id)
        self.stats_counters.num_forked_sequences += num_children
        return children

    def _check_fork(self, seq_id: int, num_children: int) -> _Sequence:
        seq = self._sequence(seq_id)
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
        seq = self._sequence(seq_id)
        self._cache(seq)
        return seq.num_tree_blocks * self.block_size

    def _cache(self, seq: _Sequence) -> None:
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
        for seq in self._batch_sequences(list(seq_ids)):
            if cache:
                self._cache(seq)
            self.tree.unlock(seq.lock_node)
            self.pool.decref(seq.private_blocks())
            del self._sequences[seq.seq_id]
            self.stats_counters.num_released_sequences += 1

    def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        """How much `num_available_blocks()` would grow if `seq_ids` were released together.

        The same for `cache=True` and `cache=False`: a block the release caches becomes evictable
        and one it does not cache becomes free, and both count as available. What the sequences
        share with others (blocks held by count, locked tree nodes) is counted only where they are
        its last holders. Changes nothing.
        """
        sequences = self._batch_sequences(list(seq_ids))
        locks: collections.Counter[int] = collections.Counter()
        nodes: dict[int, Node] = {}
        for seq in sequences:
            node = seq.lock_node
            while node.parent is not None:
                locks[node.node_id] += 1
                nodes[node.node_id] = node
                node = node.parent
        held = np.asarray([b for seq in sequences for b in seq.private_blocks()], dtype=np.intp)
        block_ids, holds = np.unique(held, return_counts=True)
        freed = int(np.count_nonzero(self.pool.ref_counts[block_ids] == holds))
        unlocked = sum(len(nodes[i].block_ids) for i, n in locks.items() if nodes[i].lock_ref == n)
        return freed + unlocked

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
        table = self._path_blocks(node, num_blocks)
        num_cached = num_blocks * self.block_size
        seq = _Sequence(next(self._seq_ids), namespace, bytearray(), table, node, num_blocks, [], num_cached, num_cached)
        self._sequences[seq.seq_id] = seq
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
        match = self.tree.match(root, key.data) if root is not None else None
        if match is None or match.num_blocks == 0:
            raise FailedPrecondition("nothing of this prefix is cached: open and release it with cache=True first", namespace=namespace)
        added = self.tree.blocks_to_pin(match.path, match.num_blocks_in_node)
        allowed = int(self.limits.max_pinned_fraction * self.pool.num_blocks)
        if self.tree.num_pinned_blocks + added > allowed:
            raise LimitExceeded("pinned_blocks", self.tree.num_pinned_blocks + added, allowed)
        node = self.tree.split(match)
        pin_key = (namespace, key.whole_block_prefix(self.block_size))
        _, count = self._pins.get(pin_key, (node, 0))
        self._pins[pin_key] = (node, count + 1)
        self.tree.lock(node)
        self.tree.add_pin(node, +1)
        return match.num_blocks * self.block_size

    def unpin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Drop one pin taken by `pin` with the same tokens (in whole blocks)."""
        key = self._key(token_ids, "token_ids")
        pin_key = (namespace, key.whole_block_prefix(self.block_size))
        if pin_key not in self._pins:
            raise NotPinned(namespace)
        node, count = self._pins.pop(pin_key)
        if count > 1:
            self._pins[pin_key] = (node, count - 1)
        self.tree.add_pin(node, -1)
        self.tree.unlock(node)

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
        counts, _ = self._append_args(seq_ids, num_token_ids, token_ids)
        needed = sum(n for n, _ in self._plan_append(self._batch_sequences(seq_ids), counts))
        available = self.num_available_blocks() - num_blocks_taken
        if needed > available:
            self.stats_counters.num_allocation_failures += 1
            raise OutOfBlocks(needed, available)

    def check_fork(self, seq_id: int, num_children: int) -> None:
        """Raise what `fork(seq_id, num_children)` would raise; changes nothing."""
        self._check_fork(seq_id, num_children)

    # -- introspection ---------------------------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._sequence(seq_id).block_table)

    def num_tokens(self, seq_id: int) -> int:
        return self._sequence(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """The computed watermark: leading tokens whose K/V is written (see `commit`)."""
        return self._sequence(seq_id).num_computed_tokens

    def sequence_ids(self) -> list[int]:
        return list(self._sequences)

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
        self.pool.check_invariants()
        self.tree.check_invariants()
        expected = [0] * self.pool.num_blocks
        for block_id in self.tree.tree_block_ids():
            expected[block_id] += 1
        locks: dict[int, int] = {}
        for seq in self._sequences.values():
            assert len(seq.block_table) == self._blocks_for(seq.num_tokens), f"seq {seq.seq_id}: table length wrong"
            assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id}: a block twice in one table"
            assert seq.num_computed_tokens <= seq.num_tokens, f"seq {seq.seq_id}: computed past its length"
            assert seq.num_tree_blocks * self.block_size <= seq.num_computed_tokens, f"seq {seq.seq_id}: cached uncomputed tokens"
            for block_id in seq.private_blocks():
                expected[block_id] += 1
            path_tokens = sum(TokenKey.count(run) for run in _path_runs(seq.lock_node))
            assert path_tokens == seq.num_tree_blocks * self.block_size, f"seq {seq.seq_id}: locked path length wrong"
            assert TokenKey.count(seq.tail_bytes) == seq.num_tokens - path_tokens, f"seq {seq.seq_id}: tail tokens lost"
            assert self.tree.roots[seq.namespace] is _root_of(seq.lock_node), f"seq {seq.seq_id}: locked path in another namespace"
            path_blocks = self._path_blocks(seq.lock_node, seq.num_tree_blocks)
            private = set(seq.private_prefix)
            for table_block, path_block in zip(seq.block_table, path_blocks, strict=False):
                assert table_block == path_block or table_block in private, f"seq {seq.seq_id}: block {table_block} neither on its path nor held"
            _count_path(seq.lock_node, locks, 1)
        for node, count in self._pins.values():
            _count_path(node, locks, count)
        for node in [*self.tree.roots.values(), *(n for _, n in self.tree.nodes())]:
            assert node.lock_ref == locks.get(node.node_id, 0), f"node {node.node_id}: lock_ref {node.lock_ref} != holders {locks.get(node.node_id, 0)}"
        for block_id, count in enumerate(expected):
            assert self.pool.ref_counts[block_id] == count, f"block {block_id}: ref_count {self.pool.ref_counts[block_id]} != holders {count}"
        for block_id in self.tree.tree_block_ids():
            assert self.pool.ref_counts[block_id] == 1, f"cached block {block_id} is also held by count"


def _check_namespace(namespace: str, field: str = "namespace") -> None:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidArgument(field, "must be 1-128 characters of A-Z a-z 0-9 _ . : / @ = + -")


def _path_runs(node: Node) -> Iterable[bytes]:
    while node.parent is not None:
        yield node.token_bytes
        node = node.parent


def _root_of(node: Node) -> Node:
    while node.parent is not None:
        node = node.parent
    return node


def _count_path(node: Node | None, locks: dict[int, int], count: int) -> None:
    """Add `count` locks to `node` and every ancestor, the namespace's root included."""
    while node is not None:
        locks[node.node_id] = locks.get(node.node_id, 0) + count
        node = node.parent
