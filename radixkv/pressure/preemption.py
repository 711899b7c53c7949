"""Preemption: take a running sequence's device blocks back, and bring it back later under the same id.

`recompute` publishes the sequence's computed full blocks to the tree (they stay cached, evictable
like any other) and drops its holds and its reservation; it keeps the tokens, so `resume` re-opens
them, re-matching whatever is still cached, and returns the slots of the rest for the worker to
recompute. Commit what the worker wrote before preempting: only computed blocks are published.

`swap` moves the blocks only the sequence holds to the host tier; it is the host tier's job
(`SwapTier`, `KVCache.preemption.swap_tier`, which refuses a pool whose host tier has no blocks). The framework here
validates, keeps the preempted records, returns reservations and counts; a swap tier moves blocks.

A preempted sequence holds nothing on the device. Only `resume` and `release` may name it;
everything else raises `SequencePreempted` (FAILED_PRECONDITION).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from radixkv.errors import FailedPrecondition, InvalidArgument, RadixKVError
from radixkv.memory.block_pairs import NO_PAIRS, Pairs
from radixkv.memory.block_pool import cdiv
from radixkv.sequences.admission import Allocator, open_planned, plan_open
from radixkv.sequences.publish import release
from radixkv.sequences.results import OpenResult
from radixkv.sequences.sequence import LiveSequence, PreemptedSequence, Sequences
from radixkv.tree.radix_tree import Node, TokenKey

PREEMPT_MODES = ("swap", "recompute")


@dataclasses.dataclass(slots=True, kw_only=True)
class PreemptResult:
    """What one `preempt` did. Apply `offloads` (swap: copy each device block to its host block)
    before any freed device block is written again."""

    seq_ids: list[int]
    mode: str
    offloads: Pairs  # int64 [n, 2] (device_block, host_block); swap, and offloads pending from evictions
    num_freed_blocks: int  # how much num_available_blocks() grew
    num_unreserved_blocks: int  # what other allocations may take now (reservations returned included)


@dataclasses.dataclass(slots=True)
class ResumeResult(OpenResult):
    """A resumed sequence, as `open` describes one: compute K/V for the `slots` (tokens from
    `num_cached_tokens` on) after applying `offloads` then `loads` (a swap's blocks, and any prefix the
    host tier held, copied to their device blocks)."""


class SwapTier(Protocol):
    """What `preempt(..., "swap")` and `resume` need from a host tier (`Preemption.swap_tier`)."""

    def swap_out(self, sequences: list[LiveSequence]) -> tuple[Pairs, list[object]]:
        """All or none: move the blocks only each sequence holds to the host and drop every device hold
        of theirs; return the offload pairs and, per sequence, what the tier keeps for it
        (`PreemptedSequence.host`). Raise a RadixKVError and change nothing if it cannot (FailedPrecondition:
        the pool has no host tier)."""
        ...

    def swap_in(self, record: PreemptedSequence, reserve: int) -> tuple[LiveSequence, ResumeResult]:
        """Bring `record` back onto the device as a live sequence with its id (not registered yet), leaving
        `reserve` blocks unreserved besides what it allocates; raise OutOfBlocks and change nothing if not."""
        ...

    def discard(self, record: PreemptedSequence) -> None:
        """A swapped-out sequence is released: free what the host tier keeps for it."""
        ...


class Preemption:
    """The preempted sequences' lifecycle over a cache's allocator and registry (`KVCache.preemption`)."""

    def __init__(self, blocks: Allocator, sequences: Sequences, root: Callable[[str], Node], *, swap: SwapTier) -> None:
        self.blocks, self.sequences, self.root, self.swap_tier = blocks, sequences, root, swap

    def preempt(self, seq_ids: Sequence[int], mode: str) -> PreemptResult:
        """See `KVCache.preempt`."""
        if mode not in PREEMPT_MODES:
            raise InvalidArgument("mode", f"must be 'swap' or 'recompute', got {mode!r}")
        live = self.sequences.batch(list(seq_ids))
        available = self.blocks.num_available()
        offloads = NO_PAIRS
        if mode == "recompute":
            self._preempt_recompute(live)
        else:
            offloads = self._preempt_swap(live, self.swap_tier)
        freed = self.blocks.num_available() - available
        return PreemptResult(
            seq_ids=[s.seq_id for s in live],
            mode=mode,
            offloads=offloads,
            num_freed_blocks=freed,
            num_unreserved_blocks=self.blocks.num_unreserved(),
        )

    def resume(self, seq_id: int) -> ResumeResult:
        """See `KVCache.resume`."""
        record = self.sequences.preempted.get(seq_id) if isinstance(seq_id, int) else None
        if record is None:
            self.sequences.get(seq_id)  # raises for an unknown id
            raise FailedPrecondition(f"seq_id: sequence {seq_id} is not preempted", field="seq_id", seq_id=seq_id)
        if record.mode == "swap":
            resumed = self._resume_swap(record, self.swap_tier)
        else:
            try:
                resumed = self._resume_recompute(record, self.root(record.namespace))
            except RadixKVError:
                self.blocks.tree.drop_empty_roots()
                raise
        self.blocks.stats.num_resumed_sequences += 1
        return resumed

    def discard(self, records: list[PreemptedSequence]) -> None:
        """Release preempted sequences: they hold nothing on the device, maybe something on the host."""
        for record in records:
            if record.mode == "swap":
                self.swap_tier.discard(record)
            del self.sequences.preempted[record.seq_id]

    def _preempt_recompute(self, live: list[LiveSequence]) -> None:
        """Publish each sequence's computed full blocks, drop its holds and reservation, keep its tokens."""
        blocks = self.blocks
        for seq in live:
            record = park(seq, "recompute")
            blocks.num_reserved -= seq.reservation()
            release(blocks.tree, blocks.pool, seq, cache=True)
            self.sequences.remove(seq)
            self.sequences.preempted[seq.seq_id] = record
        blocks.stats.num_preemptions_recompute += len(live)

    def _preempt_swap(self, live: list[LiveSequence], tier: SwapTier) -> Pairs:
        """Hand the sequences to the swap tier, then keep their records; returns the offload pairs."""
        returned = sum(seq.reservation() for seq in live)
        records = [park(seq, "swap") for seq in live]  # before the tier drops their paths
        offloads, kept = tier.swap_out(live)
        self.blocks.num_reserved -= returned
        for seq, record, host in zip(live, records, kept, strict=True):
            record.host = host
            self.sequences.remove(seq)
            self.sequences.preempted[seq.seq_id] = record
        self.blocks.stats.num_preemptions_swap += len(live)
        return offloads

    def _resume_recompute(self, record: PreemptedSequence, root: Node) -> ResumeResult:
        """Re-open `record`'s tokens under its id: match what is still cached, allocate the rest, re-reserve.

        Refused with OutOfBlocks (the blocks it takes, what reservations leave) when it does not fit;
        nothing changes then.
        """
        blocks = self.blocks
        key = TokenKey(record.token_bytes)
        planned, needed, newly_locked = plan_open(blocks.tree, [(key, root)])
        reserve = max(0, record.reserve_until - cdiv(key.num_tokens, blocks.tree.block_size))
        blocks.refuse_unless(needed + newly_locked + reserve, blocks.num_unreserved())
        del self.sequences.preempted[record.seq_id]
        ranks = [(record.priority, record.reserve_until)]
        opened = open_planned(blocks, self.sequences, planned, [record.namespace], ranks, record.seq_id)[0]
        blocks.stats.num_recomputed_tokens += key.num_tokens - opened.num_cached_tokens
        return ResumeResult(
            seq_id=opened.seq_id,
            num_cached_tokens=opened.num_cached_tokens,
            block_table=opened.block_table,
            slot_source=opened.slot_source,
            num_host_hit_tokens=opened.num_host_hit_tokens,
            offloads=opened.offloads,
            loads=opened.loads,
        )

    def _resume_swap(self, record: PreemptedSequence, tier: SwapTier) -> ResumeResult:
        """Bring a swapped-out sequence back through the swap tier, then register it and its reservation."""
        reserve = max(0, record.reserve_until - cdiv(record.num_tokens, self.blocks.tree.block_size))
        seq, resumed = tier.swap_in(record, reserve)
        del self.sequences.preempted[record.seq_id]
        self.sequences.add(seq)
        self.blocks.num_reserved += seq.reservation()
        return resumed


def all_token_bytes(seq: LiveSequence) -> bytes:
    """Every token of `seq`: its locked path's runs, top-down, then its tail."""
    runs = []
    node = seq.lock_node
    while node.parent is not None:
        runs.append(node.token_bytes)
        node = node.parent
    return b"".join(reversed(runs)) + seq.tail()


def park(seq: LiveSequence, mode: str) -> PreemptedSequence:
    """The preempted record of `seq` (taken before its holds are dropped: the tree may evict its path later)."""
    return PreemptedSequence(
        seq_id=seq.seq_id,
        namespace=seq.namespace,
        token_bytes=all_token_bytes(seq),
        num_computed_tokens=seq.num_computed_tokens,
        priority=seq.priority,
        reserve_until=seq.reserve_until,
        mode=mode,
    )
