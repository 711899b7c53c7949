"""Appending tokens to live sequences in two steps: plan (blocks to take, copy-on-write) then apply.

Planning changes nothing, so a dry run (`check_append`, `can_append`) and the append itself count
new blocks and copies the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.allocation import Allocator
from radixkv.block_pool import BlockPool
from radixkv.errors import InvalidArgument, LimitExceeded
from radixkv.results import AppendBatch, SlotPlan
from radixkv.sequence import Sequences
from radixkv.sequence_columns import Int64Array, SequenceColumns
from radixkv.token_ids import TokenIds, TokenKey


def append_counts(seq_ids: Sequence[int], num_token_ids: Sequence[int], field: str) -> list[int]:
    """`num_token_ids` checked against `seq_ids`, as ints."""
    if len(num_token_ids) != len(seq_ids):
        raise InvalidArgument(field, f"needs one entry per seq_ids entry ({len(seq_ids)}), got {len(num_token_ids)}")
    counts = list(num_token_ids)
    try:
        plain = type(sum(counts)) is int  # a list of ints: no Python-level loop (bools count as ints)
    except TypeError:
        plain = False
    if not plain:  # numpy ints, say: as Python ints
        counts = [int(n) for n in counts]
    if counts.count(1) != len(counts) and min(counts) < 1:  # a decode step's ones: no second pass
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


@dataclasses.dataclass(slots=True, eq=False)
class AppendPlan:
    """What appending `counts` tokens to the sequences at `rows` takes (see `plan`), in batch order."""

    rows: Int64Array
    counts: Int64Array | int  # 1: one token each (a decode step)
    before: Int64Array  # each sequence's length before
    after: Int64Array
    old_length: Int64Array  # each table's length before
    last: Int64Array  # each table's last block before (-1: empty); `apply` rewrites it
    num_new: Int64Array  # new table entries of each sequence, its copy-on-write copy included
    copied: dict[int, int]  # batch index -> the shared last block that sequence copies before writing
    num_drawn: int  # of the new entries, those the sequences' own reservations cover (see `radixkv.budget`)

    @property
    def num_blocks(self) -> int:
        return int(self.num_new.sum())


def plan(
    columns: SequenceColumns,
    rows: Int64Array,
    counts: list[int],
    max_tokens: int,
    ref_counts: npt.NDArray[np.int32],
    reserved: bool = True,
) -> AppendPlan:
    """How many blocks the batch takes, and which shared blocks it copies; changes nothing.

    Raises LimitExceeded for the first sequence that would grow past `max_tokens`. A partial last
    block shared with another holder is copied before the write, unless every other holder in this
    batch copies it away first: the last holder of a shared block writes in place. A copy-on-write
    copy is never drawn from a reservation. `reserved`: some sequence may hold a reservation.
    """
    bs = columns.block_size
    added = 1 if counts.count(1) == len(counts) else np.asarray(counts, dtype=np.int64)
    before = columns.num_tokens[rows]
    after = before + added
    if len(rows) and after.max() > max_tokens:
        first_over = int(np.flatnonzero(after > max_tokens)[0])
        raise LimitExceeded("max_tokens_per_request", int(after[first_over]), max_tokens)
    old_length = -(-before // bs)
    grown = -(-after // bs) - old_length
    num_drawn = int(np.minimum(grown, columns.reserve_until[rows] - old_length).clip(0).sum()) if reserved else 0
    copied: dict[int, int] = {}
    last = columns.last_block[rows]
    shared = np.flatnonzero((ref_counts[last] > 1) & (before % bs != 0))  # an empty table's -1 is never partial
    if shared.size:
        copied_away: dict[int, int] = {}  # block -> holders in this batch that copy it before writing
        for i in shared.tolist():
            block = int(last[i])
            if ref_counts[block] - copied_away.get(block, 0) > 1:
                copied_away[block] = copied_away.get(block, 0) + 1
                copied[i] = block
    if copied:
        grown[list(copied)] += 1
    return AppendPlan(rows, added, before, after, old_length, last, grown, copied, num_drawn)


def apply(
    columns: SequenceColumns, planned: AppendPlan, new_blocks: npt.NDArray[np.int32], key: bytes, pool: BlockPool
) -> tuple[list[int], list[int], list[tuple[int, int, int]], Int64Array]:
    """Apply a plan, once (`new_blocks` holds every block it takes, in order); returns the batch's columns:
    lengths after, table offsets, copies (src, dst, batch index), and the slots, whose rows took the tokens.

    Sequence i's changed table entries are exactly its share of `new_blocks` (a copy-on-write
    replaces the last entry with the first of them). Only the tables that grow are touched; every
    other sequence's new tokens land in its last block. Appending says every earlier token's K/V is
    written, so the watermark moves up to the old length.
    """
    bs, rows, before, num_new, last = columns.block_size, planned.rows, planned.before, planned.num_new, planned.last
    offsets = planned.old_length
    copies: list[tuple[int, int, int]] = []
    growing = np.flatnonzero(num_new)
    if growing.size:
        ends = np.cumsum(num_new)[growing]  # each growing sequence's share of new_blocks ends here
        grown_rows, new_lasts = rows[growing], new_blocks[ends - 1]
        columns.last_block[grown_rows] = last[growing] = new_lasts
        owner, copied = columns.owner, planned.copied
        if not copied and ends[-1] == len(growing):  # one new block each: a decode step's full last blocks
            for row, block in zip(grown_rows.tolist(), new_lasts.tolist(), strict=True):
                owner[row].block_table.push(block)  # a live row has its owner
        else:
            _grow_tables(columns, planned, growing, ends, new_blocks, pool, copies)
    columns.num_computed[rows] = np.maximum(columns.num_computed[rows], before)
    columns.num_tokens[rows] = planned.after
    if isinstance(planned.counts, int):  # one token each: it lands in the last block (a new one if it grew)
        slots = last * bs + before % bs
    else:
        slots = _slots(columns, rows, before, planned.after, planned.counts)
    columns.write_slots(slots, key)
    if copies:
        offsets = offsets.copy()
        offsets[[i for _, _, i in copies]] -= 1  # a copy-on-write rewrites the old last entry
    return planned.after.tolist(), offsets.tolist(), copies, slots


def _grow_tables(
    columns: SequenceColumns,
    planned: AppendPlan,
    growing: Int64Array,
    ends: Int64Array,
    new_blocks: npt.NDArray[np.int32],
    pool: BlockPool,
    copies: list[tuple[int, int, int]],
) -> None:
    """Each growing sequence's table takes its share of `new_blocks`, a copy-on-write first (added to `copies`)."""
    owner, copied = columns.owner, planned.copied
    rows, num_new = planned.rows[growing].tolist(), planned.num_new[growing].tolist()
    for i, row, end, n in zip(growing.tolist(), rows, ends.tolist(), num_new, strict=True):
        table = owner[row].block_table  # a live row has its owner
        src = copied.get(i)
        if src is None:
            table.extend(new_blocks[end - n : end])
            continue
        dst = int(new_blocks[end - n])
        pool.decref([src])
        table.set_last(dst)
        table.extend(new_blocks[end - n + 1 : end])
        columns.copy_block(src, dst)
        copies.append((src, dst, i))


def _slots(
    columns: SequenceColumns, rows: Int64Array, before: Int64Array, after: Int64Array, counts: Int64Array
) -> Int64Array:
    """Every appended token's slot, for a batch already applied: the table entries each sequence's new
    tokens land in are its last block alone, unless it grew."""
    bs = columns.block_size
    first = before // bs  # table index of each sequence's first new token
    num_span = -(-after // bs) - first
    span_at = np.cumsum(num_span) - num_span
    span_blocks = np.empty(int(span_at[-1] + num_span[-1]) if len(rows) else 0, dtype=np.int64)
    span_blocks[span_at] = columns.last_block[rows]
    for i in np.flatnonzero(num_span > 1).tolist():
        table = columns.owner[int(rows[i])].block_table  # type: ignore[union-attr]  # a live row has its owner
        span_blocks[span_at[i] : span_at[i] + num_span[i]] = table[int(first[i]) :]
    return SlotPlan(bs, span_blocks, span_at * bs + before % bs, counts).slots()


SMALL_BATCH = 16  # fewer sequences: one at a time costs less than the columns' fixed cost (~60 numpy calls)


def append(
    blocks: Allocator, sequences: Sequences, seq_ids: Sequence[int], counts: list[int], key: bytes, max_tokens: int
) -> AppendBatch:
    """Plan, allocate, apply: all or none. `key` holds sum(counts) validated tokens, in `seq_ids` order.

    New table entries draw on each sequence's own reservation first (see `radixkv.budget`). A batch
    of a few sequences goes one at a time (`_append_few`), a decode step's hundreds by columns; both
    plan and apply alike (tests/core/test_append.py runs every batch both ways).
    """
    if len(seq_ids) < SMALL_BATCH:
        batch = _append_few(blocks, sequences, seq_ids, counts, key, max_tokens)
    else:
        columns, reserved = sequences.columns, blocks.num_reserved > 0
        planned = plan(columns, sequences.rows(seq_ids), counts, max_tokens, blocks.pool.ref_counts, reserved)
        new_blocks = blocks.allocate(planned.num_blocks, planned.num_drawn)
        num_tokens, offsets, copies, slots = apply(columns, planned, new_blocks, key, blocks.pool)
        batch = AppendBatch(
            list(seq_ids), counts, num_tokens, offsets, planned.num_new.tolist(), new_blocks.tolist(), copies, slots
        )
    blocks.stats.num_cow_copies += len(batch.copies)
    if blocks.tree.host is not None:
        batch.offloads = blocks.tree.host.take_offloads()
    return batch


def _append_few(
    blocks: Allocator, sequences: Sequences, seq_ids: Sequence[int], counts: list[int], key: bytes, max_tokens: int
) -> AppendBatch:
    """`append` one sequence at a time: `plan` and `apply` in a loop (their docstrings say what), with the
    slots left to compute when read."""
    live, columns, pool = sequences.batch(seq_ids), sequences.columns, blocks.pool
    bs = columns.block_size
    planned: list[tuple[int, int, int | None]] = []  # (length before, new table entries, block copied first)
    copied_away: dict[int, int] = {}
    drawn = 0
    for seq, count in zip(live, counts, strict=True):
        before, length = seq.num_tokens, seq.block_table.length
        if before + count > max_tokens:
            raise LimitExceeded("max_tokens_per_request", before + count, max_tokens)
        num_new, src = -(-(before + count) // bs) - length, None
        if blocks.num_reserved and seq.reserve_until > length:
            drawn += min(num_new, seq.reserve_until - length)
        if before % bs:
            last = int(columns.last_block[seq.row])
            if pool.ref_counts[last] - copied_away.get(last, 0) > 1:
                copied_away[last] = copied_away.get(last, 0) + 1
                num_new, src = num_new + 1, last
        planned.append((before, num_new, src))
    new_blocks = blocks.allocate(sum(n for _, n, _ in planned), drawn)
    num_tokens, offsets, span_starts = [], [], []
    copies: list[tuple[int, int, int]] = []
    span_blocks: list[int] = []  # per sequence in turn, the table entries its new tokens land in
    taken = byte = 0
    for i, (seq, count, (before, num_new, src)) in enumerate(zip(live, counts, planned, strict=True)):
        table, row, mine = seq.block_table, seq.row, new_blocks[taken : taken + num_new]
        taken += num_new
        offsets.append(table.length - (src is not None))
        if src is not None:
            dst = int(mine[0])
            pool.decref([src])
            table.set_last(dst)
            columns.copy_block(src, dst)
            copies.append((src, dst, i))
            mine = mine[1:]
        table.extend(mine)
        if num_new:
            columns.last_block[row] = table.last()
        span = table[before // bs :]  # the entries the new tokens land in
        columns.write_tokens(span, key[byte : byte + 4 * count], before % bs)
        byte += 4 * count
        span_starts.append(len(span_blocks) * bs + before % bs)
        span_blocks += span.tolist()
        if columns.num_computed[row] < before:
            columns.num_computed[row] = before
        columns.num_tokens[row] = before + count
        num_tokens.append(before + count)
    slots = SlotPlan(bs, np.array(span_blocks, dtype=np.int64), span_starts, counts)
    num_block_ids = [n for _, n, _ in planned]
    return AppendBatch(list(seq_ids), counts, num_tokens, offsets, num_block_ids, new_blocks.tolist(), copies, slots)
