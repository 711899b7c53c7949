"""Appending tokens to live sequences, all or none: plan the batch, allocate, apply.

One path for every batch: a decode step (one token to each of hundreds of sequences, beams and parallel
samples among them) and a prefill chunk (many tokens to one) alike, on the registry's columns
(`radixkv.sequences.sequence`), with nothing kept between calls. Planning changes nothing, so a dry run
(`check_append`, `can_append`) counts new blocks and copies exactly as the append does. Only a sequence
that takes a block has its block table touched.

The rules, per sequence in batch order: it takes the blocks its new length needs past its table, and,
when its last block is partial and shared with another holder, a copy of that block first, unless every
other holder in this batch copies it away before it (the last holder writes in place); new table entries
draw on its reservation first; past `max_tokens` the batch is refused. A batch of a few sequences applies
them one by one in Python; a larger one in numpy over the whole batch (each numpy call costs what the loop
spends on about 8 sequences, measured in bench_core's two shapes: the scheduler's one sequence per request
and the decode step's hundreds). Both apply the same rules to the same columns; tests run one against the
other.

Forking (`fork`, below) lives here: children share every block, and each one's first append copies on write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, LimitExceeded
from radixkv.memory.block_pool import NO_BLOCKS, SMALL_BATCH, BlockPool
from radixkv.sequences.admission import Allocator
from radixkv.sequences.packed import all_ones
from radixkv.sequences.publish import publish
from radixkv.sequences.results import AppendBatch, SlotPlan
from radixkv.sequences.sequence import COMPUTED, LAST, RESERVE, TOKENS, LiveSequence, Sequences
from radixkv.tree.radix_tree import TOKEN_BYTES, RadixTree, TokenIds, TokenKey

_INT32 = np.dtype("<i4")


def append_counts(seq_ids: Sequence[int], num_token_ids: Sequence[int], field: str) -> list[int]:
    """`num_token_ids` checked against `seq_ids`, as ints."""
    if len(num_token_ids) != len(seq_ids):
        raise InvalidArgument(field, f"needs one entry per seq_ids entry ({len(seq_ids)}), got {len(num_token_ids)}")
    if all_ones(num_token_ids):
        return [1] * len(num_token_ids)  # a decode step: no pass per entry beyond that check
    counts = list(num_token_ids)
    if set(map(type, counts)) - {int}:  # numpy ints, say: as Python ints; 1.5 or "2" is refused
        try:
            as_ints = [int(n) for n in counts]
            if as_ints != counts:
                raise ValueError
        except (TypeError, ValueError):
            raise InvalidArgument(field, f"must be integers, got {counts!r:.80}") from None
        counts = as_ints
    if counts and min(counts) < 1:
        raise InvalidArgument(field, "every sequence appends at least one token")
    return counts


def append_many_args(requests: Sequence[tuple[int, TokenIds]]) -> tuple[list[int], list[int], bytes]:
    """`append_many`'s requests checked, as `append_batch`'s columns: (seq_ids, counts, the tokens packed)."""
    fields = ["token_ids"] if len(requests) == 1 else [f"requests[{i}].token_ids" for i in range(len(requests))]
    keys = [TokenKey.of(token_ids, field) for (_, token_ids), field in zip(requests, fields, strict=True)]
    return [seq_id for seq_id, _ in requests], [k.num_tokens for k in keys], b"".join(k.data for k in keys)


def append_args(seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds) -> tuple[list[int], bytes]:
    """`append_batch`'s arguments checked: (the counts as ints, the tokens packed)."""
    counts = append_counts(seq_ids, num_token_ids, "num_token_ids")
    key = TokenKey.of(token_ids)
    if sum(counts) != key.num_tokens:
        raise InvalidArgument("token_ids", f"sum(num_token_ids) is {sum(counts)}, token_ids holds {key.num_tokens}")
    return counts, key.data


@dataclasses.dataclass(slots=True, kw_only=True)
class AppendPlan:
    """What appending `counts[i]` tokens to the sequence in `rows[i]` takes, column by column: lists for a
    small batch, int64 arrays for a large one."""

    rows: list[int] | npt.NDArray[np.intp]  # each sequence's row in the registry's columns
    lengths: list[int] | npt.NDArray[np.int64]  # tokens before
    lasts: list[int] | npt.NDArray[np.int64]  # the last block before (-1: an empty table)
    num_new: list[int] | npt.NDArray[np.int64]  # new table entries
    copies: list[int] | npt.NDArray[np.int64]  # 1 where the shared partial last block is copied before the write
    ones: bool  # one token each: a decode step
    num_blocks: int  # blocks the batch takes: new entries plus copies
    num_drawn: int  # of those, the ones that come out of the sequences' own reservations


def plan_batch(
    sequences: Sequences,
    seq_ids: Sequence[int],
    counts: list[int],
    block_size: int,
    max_tokens: int,
    ref_counts: npt.NDArray[np.int32],
    reserved: bool = True,
) -> AppendPlan:
    """Plan one batch; raises what the batch's ids, or the first sequence that would grow past `max_tokens`,
    make it raise. `reserved`: whether any reservation exists to draw on (none: `num_drawn` is 0 without a look).
    """
    rows = sequences.rows(seq_ids)
    if len(rows) <= SMALL_BATCH:
        return _plan_each(sequences, rows.tolist(), counts, block_size, max_tokens, ref_counts, reserved)
    return _plan_columns(sequences, rows, counts, block_size, max_tokens, ref_counts, reserved)


def _plan_each(
    sequences: Sequences,
    rows: list[int],
    counts: list[int],
    bs: int,
    max_tokens: int,
    ref_counts: npt.NDArray[np.int32],
    reserved: bool,
) -> AppendPlan:
    cell = sequences.columns.cell
    lengths, lasts, num_new, copies = [], [], [], []
    copied_away: dict[int, int] = {}  # block -> holders in this batch that copy it before writing
    num_blocks = num_drawn = 0
    for row, count in zip(rows, counts, strict=True):
        n, last = cell[TOKENS][row], cell[LAST][row]
        if n + count > max_tokens:
            raise LimitExceeded("max_tokens_per_request", n + count, max_tokens)
        before = -(-n // bs)
        new = -(-(n + count) // bs) - before
        copy = 0
        if n & (bs - 1) and (held := int(ref_counts[last])) > 1 and held - copied_away.get(last, 0) > 1:
            copied_away[last] = copied_away.get(last, 0) + 1
            copy = 1
        if reserved and (room := cell[RESERVE][row] - before) > 0:
            num_drawn += min(new, room)
        lengths.append(n)
        lasts.append(last)
        num_new.append(new)
        copies.append(copy)
        num_blocks += new + copy
    return AppendPlan(
        rows=rows,
        lengths=lengths,
        lasts=lasts,
        num_new=num_new,
        copies=copies,
        ones=counts.count(1) == len(counts),
        num_blocks=num_blocks,
        num_drawn=num_drawn,
    )


def _plan_columns(
    sequences: Sequences,
    rows: npt.NDArray[np.intp],
    counts: list[int],
    bs: int,
    max_tokens: int,
    ref_counts: npt.NDArray[np.int32],
    reserved: bool,
) -> AppendPlan:
    col = sequences.columns.col
    lengths, lasts = col[TOKENS][rows], col[LAST][rows]
    within = lengths & (bs - 1)  # each first new token's place in its block (block sizes are powers of two)
    ones = counts.count(1) == len(counts)
    if ones:  # a decode step: a block for each sequence at a boundary
        num_new = (within == 0).view(np.int8).astype(np.int64)
        longest = int(lengths.max()) + 1
    else:
        after = lengths + np.array(counts, dtype=np.int64)
        num_new = (after + bs - 1) // bs - (lengths + bs - 1) // bs
        longest = int(after.max())
    if longest > max_tokens:
        after = lengths + (1 if ones else np.array(counts, dtype=np.int64))
        raise LimitExceeded("max_tokens_per_request", int(after[np.argmax(after > max_tokens)]), max_tokens)
    shared = (within != 0) & (ref_counts[lasts] > 1)  # an empty table has no partial block to read
    copies = shared.view(np.int8).astype(np.int64)
    if shared.any():  # of the batch's writers into one shared block, in order, the last holder writes in place
        copied_away: dict[int, int] = {}
        candidates = np.flatnonzero(shared)
        blocks = lasts[candidates]
        held = ref_counts[blocks]
        for i, block, holders in zip(candidates.tolist(), blocks.tolist(), held.tolist(), strict=True):
            away = copied_away.get(block, 0)
            if holders - away > 1:
                copied_away[block] = away + 1
            else:
                copies[i] = 0
    num_drawn = 0
    if reserved:  # new table entries up to each sequence's reservation (a copy never draws)
        room = col[RESERVE][rows] - (lengths + bs - 1) // bs
        num_drawn = int(np.minimum(num_new, np.maximum(room, 0)).sum())
    num_blocks = int(num_new.sum()) + int(copies.sum())
    return AppendPlan(
        rows=rows,
        lengths=lengths,
        lasts=lasts,
        num_new=num_new,
        copies=copies,
        ones=ones,
        num_blocks=num_blocks,
        num_drawn=num_drawn,
    )


def apply_plan(
    sequences: Sequences,
    seq_ids: Sequence[int],
    counts: list[int],
    plan: AppendPlan,
    new_blocks: npt.NDArray[np.int32],
    key: bytes,
    pool: BlockPool,
    block_size: int,
) -> AppendBatch:
    """Apply a plan (`new_blocks` holds every block it takes, sequence by sequence, each one's copy first) and
    describe the batch in columns. Appending says every earlier token's K/V is written: each watermark moves up
    to the sequence's length before the append."""
    if isinstance(plan.rows, list):
        return _apply_each(sequences, seq_ids, counts, plan, new_blocks, key, pool, block_size)
    return _apply_columns(sequences, seq_ids, counts, plan, new_blocks, key, pool, block_size)


def _apply_each(
    sequences: Sequences,
    seq_ids: Sequence[int],
    counts: list[int],
    plan: AppendPlan,
    new_blocks: npt.NDArray[np.int32],
    key: bytes,
    pool: BlockPool,
    bs: int,
) -> AppendBatch:
    columns, view = sequences.columns, memoryview(key)
    cell = columns.cell
    after, offsets, taken, copies, span_starts = [], [], [], [], []
    span_blocks: list[npt.NDArray[np.int32] | list[int]] = []  # joined once, not a Python int per block
    byte = start = num_spanned = 0
    rows = plan.rows
    for i, (row, count, n, last, new, copy) in enumerate(
        zip(rows, counts, plan.lengths, plan.lasts, plan.num_new, plan.copies, strict=True)
    ):
        columns.extend_tail(row, view[byte : byte + count * TOKEN_BYTES])
        byte += count * TOKEN_BYTES
        cell[COMPUTED][row], cell[TOKENS][row] = n, n + count
        table = sequences.at(row).block_table
        span_starts.append(num_spanned * bs + (n & (bs - 1)))
        num_spanned += (1 if n & (bs - 1) else 0) + new
        if copy:
            dst = int(new_blocks[start])
            copies.append((last, dst, i))
            table.set_last(dst)
        if n & (bs - 1):
            span_blocks.append([table.last])  # its partial last block (or the copy of it) takes the first tokens
        if new:
            growth = new_blocks[start + copy : start + copy + new]
            table.extend(growth)
            span_blocks.append(growth)
        if new or copy:
            cell[LAST][row] = table.last
        start += new + copy
        after.append(n + count)
        offsets.append(-(-n // bs) - copy)
        taken.append(new + copy)
    if copies:
        pool.drop_copied([src for src, _, _ in copies])
    spans = span_blocks[0] if len(span_blocks) == 1 else np.concatenate(span_blocks) if span_blocks else NO_BLOCKS
    slots = SlotPlan(block_size=bs, span_blocks=spans, span_starts=span_starts, counts=counts)
    return AppendBatch(
        seq_ids=list(seq_ids),
        num_appended=counts,
        num_tokens=after,
        table_offsets=offsets,
        num_block_ids=taken,
        block_ids=new_blocks,
        copies=copies,
        slot_source=slots,
    )


def _apply_columns(
    sequences: Sequences,
    seq_ids: Sequence[int],
    counts: list[int],
    plan: AppendPlan,
    new_blocks: npt.NDArray[np.int32],
    key: bytes,
    pool: BlockPool,
    bs: int,
) -> AppendBatch:
    columns, col = sequences.columns, sequences.columns.col
    rows, lengths, lasts = np.asarray(plan.rows), np.asarray(plan.lengths), np.asarray(plan.lasts)
    num_new, copied = np.asarray(plan.num_new), np.asarray(plan.copies)
    if plan.ones:  # a decode step: a token each, written to every tail at once
        columns.append_tokens(rows, np.frombuffer(key, dtype=_INT32))
        after = lengths + 1
    else:
        view, byte = memoryview(key), 0
        for row, count in zip(rows.tolist(), counts, strict=True):
            columns.extend_tail(row, view[byte : byte + count * TOKEN_BYTES])
            byte += count * TOKEN_BYTES
        after = lengths + np.array(counts, dtype=np.int64)
    col[COMPUTED][rows] = lengths
    col[TOKENS][rows] = after
    taken, last_after = num_new, lasts  # taken: [n] blocks each takes, its copy first
    copies: list[tuple[int, int, int]] = []
    if plan.num_blocks:
        has_copies = bool(copied.any())
        taken = num_new + copied if has_copies else num_new
        grew = np.flatnonzero(taken)
        starts = None if plan.ones else np.cumsum(taken) - taken  # each one's first block (a decode step: one each)
        copying = copied if has_copies else None
        ends, copies = _grow_tables(sequences, rows, grew, taken, starts, copying, new_blocks, lasts)
        if copies:
            pool.drop_copied([src for src, _, _ in copies])
        last_after = lasts.copy()  # each one's last block taken ends its table (a decode step's: its only one)
        last_after[grew] = ends
        col[LAST][rows[grew]] = ends
    within = lengths & (bs - 1)  # where each sequence's first new token lands in its current last block
    slots: SlotPlan | npt.NDArray[np.int64]
    if plan.ones:  # a token each lands in its last block now: the one it had, its copy, or its new block
        slots = last_after * bs + within
    else:
        slots = _slot_plan(lasts, num_new, copied, within, taken, new_blocks, counts, bs)
    offsets = (lengths + bs - 1) // bs - copied
    return AppendBatch(
        seq_ids=list(seq_ids),
        num_appended=counts,
        num_tokens=after,
        table_offsets=offsets,
        num_block_ids=taken,
        block_ids=new_blocks,
        copies=copies,
        slot_source=slots,
    )


def _grow_tables(
    sequences: Sequences,
    rows: npt.NDArray[np.intp],
    grew: npt.NDArray[np.intp],
    taken: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64] | None,
    copies: npt.NDArray[np.int64] | None,
    new_blocks: npt.NDArray[np.int32],
    lasts: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int32] | list[int], list[tuple[int, int, int]]]:
    """Write each sequence's share of `new_blocks` into its table: the copy over its last entry, then growth.
    `starts`: where each one's share begins (None: a block each); `copies`: which ones copy (None: none).
    Returns each grown table's last block, and the copies made as (src, dst, index in the batch): one pass over
    the sequences that grew, in Python, rather than a numpy call per column."""
    at = sequences.at
    if starts is None:  # a decode step: a block each, a copy of its partial last block or its next, never both
        if copies is None:
            for row, block_id in zip(rows[grew].tolist(), new_blocks.tolist(), strict=True):
                at(row).block_table.append(block_id)
            return new_blocks, []
        made = []
        each = zip(
            grew.tolist(),
            rows[grew].tolist(),
            new_blocks.tolist(),
            copies[grew].tolist(),
            lasts[grew].tolist(),
            strict=True,
        )
        for i, row, block_id, copy, last in each:
            table = at(row).block_table
            if copy:
                table.set_last(block_id)
                made.append((last, block_id, i))
            else:
                table.append(block_id)
        return new_blocks, made
    block_ids: list[int] = new_blocks.tolist()
    indices: list[int] = grew.tolist()
    copying = copies[grew].tolist() if copies is not None else [0] * len(indices)
    ends, made = [], []
    shares = zip(
        indices,
        rows[grew].tolist(),
        starts[grew].tolist(),
        taken[grew].tolist(),
        copying,
        lasts[grew].tolist(),
        strict=True,
    )
    for i, row, start, num, copy, last in shares:
        table = at(row).block_table
        if copy:
            table.set_last(block_ids[start])
            made.append((last, block_ids[start], i))
        if num - copy == 1:
            table.append(block_ids[start + copy])
        elif num > copy:
            table.extend(new_blocks[start + copy : start + num])
        ends.append(table.last)
    return ends, made


def _slot_plan(
    lasts: npt.NDArray[np.int64],
    num_new: npt.NDArray[np.int64],
    copies: npt.NDArray[np.int64],
    within: npt.NDArray[np.int64],
    taken: npt.NDArray[np.int64],
    new_blocks: npt.NDArray[np.int32],
    counts: list[int],
    block_size: int,
) -> SlotPlan:
    """The blocks each sequence's new tokens land in, in turn: its current last block (or its copy) when that is
    partial, then its new blocks; and where its first token lands among them."""
    partial = (within != 0).astype(np.int64)
    spans = partial + num_new  # [n] blocks each sequence's tokens land in
    offsets = np.cumsum(spans) - spans
    span_blocks = np.empty(int(spans.sum()), dtype=np.int32)
    is_copy = np.zeros(len(new_blocks), dtype=bool)
    is_copy[(np.cumsum(taken) - taken)[copies > 0]] = True
    current = lasts.copy()
    current[copies > 0] = new_blocks[is_copy]
    span_blocks[offsets[partial > 0]] = current[partial > 0]
    growth = new_blocks[~is_copy]
    firsts = np.cumsum(num_new) - num_new
    span_blocks[np.repeat(offsets + partial - firsts, num_new) + np.arange(len(growth))] = growth
    return SlotPlan(
        block_size=block_size,
        span_blocks=span_blocks,
        span_starts=(offsets * block_size + within).tolist(),
        counts=counts,
    )


def append(
    blocks: Allocator, sequences: Sequences, seq_ids: Sequence[int], counts: list[int], key: bytes, max_tokens: int
) -> AppendBatch:
    """Plan, allocate, apply: all or none. `key` holds sum(counts) validated tokens, in `seq_ids` order.

    New table entries draw on each sequence's own reservation first (see `radixkv.sequences.admission`).
    """
    pool, bs = blocks.pool, blocks.tree.block_size
    plan = plan_batch(sequences, seq_ids, counts, bs, max_tokens, pool.ref_counts, blocks.num_reserved > 0)
    new_blocks = blocks.allocate(plan.num_blocks, plan.num_drawn)
    batch = apply_plan(sequences, seq_ids, counts, plan, new_blocks, key, pool, bs)
    blocks.stats.num_cow_copies += len(batch.copies)
    batch.offloads = blocks.host.take_offloads()
    return batch


# -- from sequences/fork.py (merged, issue 41: one concept, one module):
# Forking a sequence into children that share every block (parallel samples, beams).
#
# The parent's computed full blocks enter the tree first (fork after committing the parent's K/V, as
# samplers do), so the family shares them through the locked path. Any other block the family shares
# is held by count: full blocks not yet computed (no one appends into a full block; once every holder
# has computed one, the family publishes it together, see `radixkv.sequences.publish`) and the partial
# last block, which no one writes while it is shared (a write copies it). Children inherit the parent's
# computed watermark, and join its family (`LiveSequence.family`).


def check_fork(sequences: Sequences, seq_id: int, num_children: int, max_children: int) -> LiveSequence:
    """The sequence to fork, or the error `fork` would raise."""
    seq = sequences.get(seq_id)
    if not isinstance(num_children, int) or isinstance(num_children, bool) or num_children < 1:
        raise InvalidArgument("num_children", f"must be a positive integer, got {num_children!r}")
    if num_children > max_children:
        raise LimitExceeded("max_fork_children", num_children, max_children)
    return seq


def fork(tree: RadixTree, pool: BlockPool, sequences: Sequences, seq: LiveSequence, num_children: int) -> list[int]:
    """Publish `seq`'s computed blocks, then add `num_children` holders of everything it holds; returns their ids."""
    publish(tree, pool, seq)
    pool.incref(seq.private_blocks(), by=num_children)
    tree.lock(seq.lock_node, num_children)
    return [sequences.fork(seq).seq_id for _ in range(num_children)]
