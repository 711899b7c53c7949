"""Appending tokens to live sequences in two steps: plan (blocks to take, copy-on-write) then apply.

Planning changes nothing, so a dry run (`check_append`, `can_append`) and the append itself count
new blocks and copies the same way. A decode step (many sequences, one token each, no shared last
block) takes `decode_step`: the batch's decode run plans and applies it the same way on arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, LimitExceeded
from radixkv.memory.block_pool import BlockPool
from radixkv.pressure.budget import num_drawn
from radixkv.sequences.allocation import Allocator
from radixkv.sequences.packed import all_ones
from radixkv.sequences.results import AppendBatch, SlotPlan
from radixkv.sequences.sequence import LiveSequence, Sequences
from radixkv.tree.token_ids import TOKEN_BYTES, TokenIds, TokenKey

AppendPlan = tuple[int, int | None]  # (num_new_blocks, cow_src): the shared last block to copy first, if any


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


def plan_append(
    seq: LiveSequence, count: int, block_size: int, ref_counts: npt.NDArray[np.int32], copied_away: dict[int, int]
) -> AppendPlan:
    """How many blocks appending `count` tokens to `seq` takes, and which block it copies first.

    A partial last block shared with another holder is copied before the write, unless every other
    holder in this batch (`copied_away`, updated here) already copies it away: the last holder of a
    shared block writes in place. Changes nothing else.
    """
    table, num_tokens = seq.block_table, seq.num_tokens
    num_new = -(-(num_tokens + count) // block_size) - table.length  # ceiling division, inlined: once per sequence
    if num_tokens % block_size:
        last = table.last
        held = ref_counts[last]
        if held > 1 and held - copied_away.get(last, 0) > 1:
            copied_away[last] = copied_away.get(last, 0) + 1
            return num_new + 1, last
    return num_new, None


def plan_batch(
    sequences: list[LiveSequence],
    counts: list[int],
    block_size: int,
    max_tokens: int,
    ref_counts: npt.NDArray[np.int32],
) -> list[AppendPlan]:
    """`plan_append` for each sequence of one batch; raises LimitExceeded for one that would grow past `max_tokens`."""
    copied_away: dict[int, int] = {}  # block -> holders in this batch that copy it before writing
    plans = []
    for seq, count in zip(sequences, counts, strict=True):
        if seq.num_tokens + count > max_tokens:
            raise LimitExceeded("max_tokens_per_request", seq.num_tokens + count, max_tokens)
        plans.append(plan_append(seq, count, block_size, ref_counts, copied_away))
    return plans


def apply_append(
    seq: LiveSequence,
    tokens: memoryview,
    count: int,
    cow_src: int | None,
    new_blocks: npt.NDArray[np.int32],
    pool: BlockPool,
) -> int:
    """Grow `seq` by `count` tokens into `new_blocks` as planned; returns the first table entry that changed.

    Appending says every earlier token's K/V is written, so the watermark moves up to the old length.
    """
    table = seq.block_table
    offset = table.length
    if cow_src is not None:
        pool.decref([cow_src])
        table.set_last(int(new_blocks[0]))
        offset -= 1
        table.extend(new_blocks[1:])
    elif new_blocks.size:
        table.extend(new_blocks)
    seq.tail_bytes += tokens
    num_tokens = seq.num_tokens
    if seq.num_computed_tokens < num_tokens:
        seq.num_computed_tokens = num_tokens
    seq.num_tokens = num_tokens + count
    return offset


_NO_BLOCKS = np.empty(0, dtype=np.int32)
_NO_BLOCKS.flags.writeable = False


def apply_batch(
    seq_ids: Sequence[int],
    sequences: list[LiveSequence],
    counts: list[int],
    plans: list[AppendPlan],
    new_blocks: npt.NDArray[np.int32],
    key: bytes,
    pool: BlockPool,
    block_size: int,
) -> AppendBatch:
    """Apply a planned batch (`new_blocks` holds every block the plans take, in order) and describe it in columns.

    Sequence i's changed table entries are exactly its share of `new_blocks` (a copy-on-write
    replaces the last entry with the first of them), so that array is the batch's `block_ids`.
    A decode step appends one token to each of hundreds of sequences, mostly without a new block,
    so the loop touches only plain ints for them (no array slice per sequence).
    """
    bs, view = block_size, memoryview(key)
    num_tokens_after, offsets, num_block_ids, copies = [], [], [], []
    span_blocks: list[int] = []  # per sequence in turn, the table blocks its new tokens land in
    span_starts: list[int] = []  # position of each sequence's first new token, relative to span_blocks
    taken = byte = num_span_blocks = 0
    for i, (seq, count, (num_new, cow_src)) in enumerate(zip(sequences, counts, plans, strict=True)):
        mine = new_blocks[taken : taken + num_new] if num_new else _NO_BLOCKS
        taken += num_new
        start, num_bytes = seq.num_tokens, count * TOKEN_BYTES
        offset = apply_append(seq, view[byte : byte + num_bytes], count, cow_src, mine, pool)
        byte += num_bytes
        if cow_src is not None:
            copies.append((cow_src, int(mine[0]), i))
        first, table = start // bs, seq.block_table
        span_starts.append(num_span_blocks * bs + start - first * bs)
        if table.length - first == 1:  # the new tokens all land in the last block
            span_blocks.append(table.last)
        else:
            span_blocks.extend(table[first:].tolist())
        num_span_blocks += table.length - first
        num_tokens_after.append(seq.num_tokens)
        offsets.append(offset)
        num_block_ids.append(num_new)
    plan = SlotPlan(bs, np.array(span_blocks, dtype=np.int32), span_starts, counts)
    block_ids: list[int] = new_blocks.tolist()
    return AppendBatch(list(seq_ids), counts, num_tokens_after, offsets, num_block_ids, block_ids, copies, plan)


# Batches this large that append one token each take `decode_step`: below it, its fixed cost (a few numpy
# calls) outweighs what it saves per sequence (bench_core's engine replay appends to one or a few at a time).
DECODE_STEP_MIN = 16


def decode_step(
    blocks: Allocator, sequences: Sequences, seq_ids: Sequence[int], key: bytes, max_tokens: int
) -> AppendBatch | None:
    """One token to each sequence of `seq_ids`, on the batch's decode run (radixkv.sequences.decode_run); None, changing
    nothing, where `append`'s general path must serve (a sequence at `max_tokens`, or one writing into a
    partial block another sequence shares)."""
    return sequences.decode_run(seq_ids).step(blocks, key, max_tokens)


def append(
    blocks: Allocator, sequences: Sequences, seq_ids: Sequence[int], counts: list[int], key: bytes, max_tokens: int
) -> AppendBatch:
    """Plan, allocate, apply: all or none. `key` holds sum(counts) validated tokens, in `seq_ids` order.

    New table entries draw on each sequence's own reservation first (see `radixkv.pressure.budget`).
    """
    one_each = len(seq_ids) >= DECODE_STEP_MIN and counts.count(1) == len(counts)
    batch = decode_step(blocks, sequences, seq_ids, key, max_tokens) if one_each else None
    if batch is None:
        live = sequences.batch(seq_ids)  # ends any decode run first
        plans = plan_batch(live, counts, blocks.tree.block_size, max_tokens, blocks.pool.ref_counts)
        drawn = num_drawn(live, counts, blocks.tree.block_size) if blocks.num_reserved else 0  # none: none to draw on
        new_blocks = blocks.allocate(sum(n for n, _ in plans), drawn)
        batch = apply_batch(seq_ids, live, counts, plans, new_blocks, key, blocks.pool, blocks.tree.block_size)
        blocks.stats.num_cow_copies += len(batch.copies)
    if blocks.tree.host is not None:
        batch.offloads = blocks.tree.host.take_offloads()
    return batch
