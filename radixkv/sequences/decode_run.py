"""A decode loop's batch kept in columns from one step to the next, written back when anything else asks.

A decode loop appends one token to the same hundreds of sequences, step after step. Reading and
writing each sequence's length, last block and tokens costs a few cache misses per sequence (its
object, its table, its tail and its ints live apart), and a server's step runs after gRPC has
evicted every one of them: about 110 µs of a 256-sequence step over the Session stream went
there (bench_service). A run keeps the batch's lengths, last blocks and table lengths in arrays,
and journals the steps' tokens and new blocks, so a step is a few numpy calls over a few KiB and
touches no sequence and no table.

`Sequences` owns the run: it settles it (writes lengths, watermarks, tokens and blocks back) before
it hands out any sequence, so nothing outside this module ever reads a sequence the run is ahead of.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from radixkv.sequences.results import AppendBatch
from radixkv.tree.token_ids import TOKEN_BYTES

if TYPE_CHECKING:
    from radixkv.sequences.allocation import Allocator
    from radixkv.sequences.sequence import LiveSequence

# What this many steps journaled moves into the sequences (tokens into tails, blocks into tables) while
# the run goes on, so a settle after a long run moves at most this many steps' worth. For 256 sequences
# that one step in 256 pays about a millisecond (about 4 µs a step; scratch measurement, 256 sequences of
# 100 tokens), which leaves the p99 of a decode loop alone.
FOLD_STEPS = 256
_TOKEN = np.dtype(f"V{TOKEN_BYTES}")  # one token's bytes as an opaque item


def same_ids(seq_ids: object, known: list[int]) -> bool:
    """Whether `seq_ids` is the batch `known`, as plain ints: 2.0 or numpy's 2 compare equal to 2, yet
    `Sequences.batch` refuses them by name, so such a list is never taken for a batch found before."""
    return type(seq_ids) is list and seq_ids == known and type(sum(seq_ids)) is int


class DecodeRun:
    """The columns of one batch (`seq_ids`, in order) while only decode steps touch it."""

    __slots__ = ("seq_ids", "_live", "_tables", "_lengths", "_max_length", "_lasts", "_table_lengths",
                 "_reserve_until", "_keys", "_new_blocks", "_stepped")  # fmt: skip

    def __init__(self, seq_ids: list[int], live: list[LiveSequence]) -> None:
        self.seq_ids = seq_ids
        self._live = live
        self._tables = [seq.block_table for seq in live]
        self._lengths = np.array([seq.num_tokens for seq in live], dtype=np.int64)
        self._max_length = int(self._lengths.max()) if live else 0  # every step adds one to each length
        self._lasts = np.array([table.last for table in self._tables], dtype=np.int64)
        self._table_lengths = np.array([table.length for table in self._tables], dtype=np.int64)
        self._reserve_until = np.array([seq.reserve_until for seq in live], dtype=np.int64)  # fixed at admission
        self._keys: list[bytes] = []  # each step's tokens (one per sequence), not yet in the tails
        # Each step's new blocks, not yet in the tables: (the sequences that opened one, their blocks).
        self._new_blocks: list[tuple[npt.NDArray[np.intp], npt.NDArray[np.int32]]] = []
        self._stepped = False

    def matches(self, seq_ids: object) -> bool:
        return same_ids(seq_ids, self.seq_ids)

    def step(self, blocks: Allocator, key: bytes, max_tokens: int) -> AppendBatch | None:
        """One token (`key`: one per sequence, validated) to each sequence; None, changing nothing, where the
        general path must serve: a sequence at `max_tokens`, or one writing into a partial block another shares.

        Raises:
            OutOfBlocks: the new blocks are not there; nothing changed.
        """
        bs = blocks.tree.block_size
        lengths, lasts, table_lengths = self._lengths, self._lasts, self._table_lengths
        n = len(lengths)
        if not n or self._max_length >= max_tokens:
            return None
        within = lengths % bs  # the token's place in its block
        opens = within == 0  # the token opens a new block
        opened = opens.nonzero()[0]
        num_new = len(opened)
        # A partial last block shared with another sequence (a fork's) must be copied first. Only a fork of a
        # sequence of the batch shares one, and that ends the run (it asks `Sequences` for it), while the blocks
        # a run takes are its own: so the first step checks for the whole run.
        if not self._stepped and num_new < n and int(blocks.pool.ref_counts[lasts[~opens]].max()) > 1:
            return None
        # A new table entry below a sequence's reservation draws on it (radixkv.pressure.budget).
        drawn = int(np.count_nonzero(opens & (self._reserve_until > table_lengths))) if blocks.num_reserved else 0
        new_blocks = blocks.allocate(num_new, drawn)
        offsets: list[int] = table_lengths.tolist()  # where each table's new block goes, if any
        if num_new:
            self._new_blocks.append((opened, new_blocks))
        table_lengths[opened] += 1
        lasts[opened] = new_blocks
        self._lengths = after = lengths + 1
        self._max_length += 1
        self._keys.append(key)
        self._stepped = True
        if len(self._keys) == FOLD_STEPS:
            self._fold()
        num_block_ids: list[int] = opens.view(np.int8).tolist()
        block_ids: list[int] = new_blocks.tolist()
        return AppendBatch(
            list(self.seq_ids), [1] * n, after.tolist(), offsets, num_block_ids, block_ids, [], lasts * bs + within
        )

    def settle(self) -> None:
        """Write the run into its sequences: lengths, tokens, blocks, and the watermark each append raised."""
        if not self._stepped:
            return
        self._fold()
        for seq, length in zip(self._live, self._lengths.tolist(), strict=True):
            seq.num_computed_tokens = length - 1  # the last append marked every token before its own
            seq.num_tokens = length

    def _fold(self) -> None:
        """Move the journaled tokens into the tails (sequence i's are column i of the steps' keys) and the new
        blocks into the tables (sequence i's in step order: a stable sort by sequence keeps it)."""
        keys = self._keys
        if keys:
            steps = np.frombuffer(b"".join(keys), dtype=_TOKEN).reshape(len(keys), len(self._live))
            rows = np.ascontiguousarray(steps.T).view(np.dtype(f"V{TOKEN_BYTES * len(keys)}")).ravel().tolist()
            for seq, tokens in zip(self._live, rows, strict=True):
                seq.tail_bytes += tokens
            keys.clear()
        if self._new_blocks:
            which = np.concatenate([w for w, _ in self._new_blocks])
            order = np.argsort(which, kind="stable")
            blocks = np.concatenate([b for _, b in self._new_blocks])[order]
            which = which[order]
            starts = np.flatnonzero(np.diff(which, prepend=-1))  # where each sequence's run of blocks begins
            ends = [*starts[1:].tolist(), len(which)]
            for i, start, end in zip(which[starts].tolist(), starts.tolist(), ends, strict=True):
                self._tables[i].extend(blocks[start:end])
            self._new_blocks.clear()
