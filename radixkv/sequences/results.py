"""What the core's calls return: plain records a scheduler reads (and the client rebuilds from the wire)."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from radixkv.memory.block_pairs import NO_PAIRS, Pairs
from radixkv.sequences.handoff import BlockTableOf, StepArrays, copy_pairs


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class SlotPlan:
    """What a batch's slots follow from: the table blocks each sequence's new tokens land in.

    Kept instead of the slots themselves, so a caller that never reads them (a scheduler whose
    workers derive slots from block tables) never pays for them. Serves one sequence (an open) or
    a batch (an append step) alike; the array is computed on the first `slots()` and kept.
    """

    block_size: int
    span_blocks: npt.NDArray[np.int32] | list[int]  # per sequence in turn, the blocks its new tokens land in
    span_starts: list[int]  # each sequence's first new token, as a position within span_blocks
    counts: list[int]
    computed: npt.NDArray[np.int64] | None = None  # the slots, once read

    def slots(self) -> npt.NDArray[np.int64]:
        """slot of token j = span_blocks[p_j // block_size] * block_size + p_j % block_size."""
        if self.computed is None:
            bs = self.block_size
            counts = np.asarray(self.counts, dtype=np.int64)
            firsts = np.cumsum(counts) - counts
            starts = np.repeat(np.asarray(self.span_starts, dtype=np.int64) - firsts, counts)
            positions = np.arange(int(counts.sum()), dtype=np.int64) + starts
            self.computed = np.asarray(self.span_blocks, dtype=np.int64)[positions // bs] * bs + positions % bs
        return self.computed


def as_slots(source: SlotPlan | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """A record's slots: the array it was given (the client's, from the wire) or its plan's."""
    return source.slots() if isinstance(source, SlotPlan) else source


@dataclasses.dataclass(slots=True, kw_only=True)
class OpenResult:
    """`slots`: [num_tokens - num_cached_tokens], where the uncached tokens' K/V go.

    `block_table` is a read-only int32 array (`.tolist()` for a list): the cached path's blocks
    joined with the new ones in one copy, never a Python int per block.

    With a host tier, apply `offloads` (device -> host), then `loads` (host -> device: the host-hit blocks of
    the table) with `kernels.swap_blocks` before the step (see `radixkv.tree.host_tier` for why that order).
    """

    seq_id: int
    num_cached_tokens: int  # prefix served from the cache: compute K/V only for the rest
    block_table: npt.NDArray[np.int32]
    slot_source: SlotPlan | npt.NDArray[np.int64]  # the slots, or what they follow from
    num_host_hit_tokens: int = 0  # of num_cached_tokens, those the host tier held (brought in by `loads`)
    offloads: Pairs = dataclasses.field(default_factory=lambda: NO_PAIRS)  # int64 [n, 2] (device_block, host_block)
    loads: Pairs = dataclasses.field(default_factory=lambda: NO_PAIRS)  # int64 [n, 2] (host_block, device_block)

    @property
    def slots(self) -> npt.NDArray[np.int64]:
        return as_slots(self.slot_source)

    def step_arrays(self) -> StepArrays:
        """This sequence's prefill for the worker (`StepArrays.from_opens` for a batch)."""
        return StepArrays.from_opens([self])


class AppendResult:
    """One sequence's row of an `AppendBatch`, read through (nothing is copied until asked for).

    `block_table[table_offset:]` is now `block_ids`; apply `copies` (copy-on-write of a shared
    partial block) before writing `slots` ([num_appended]).
    """

    __slots__ = ("batch", "index", "_block_start", "_slot_start")

    def __init__(self, batch: AppendBatch, index: int, *, block_start: int, slot_start: int) -> None:
        self.batch, self.index = batch, index
        self._block_start, self._slot_start = block_start, slot_start  # this row's start in the columns

    @property
    def seq_id(self) -> int:
        return self.batch.seq_ids[self.index]

    @property
    def num_tokens(self) -> int:
        """Sequence length after the append."""
        return self.batch.num_tokens[self.index]

    @property
    def table_offset(self) -> int:
        return self.batch.table_offsets[self.index]

    @property
    def block_ids(self) -> list[int]:
        return self.batch.block_ids[self._block_start : self._block_start + self.batch.num_block_ids[self.index]]

    @property
    def copies(self) -> list[tuple[int, int]]:
        return [(src, dst) for src, dst, index in self.batch.copies if index == self.index]

    @property
    def slots(self) -> npt.NDArray[np.int64]:
        return self.batch.slots[self._slot_start : self._slot_start + self.batch.num_appended[self.index]]

    def __repr__(self) -> str:
        fields = ("seq_id", "num_tokens", "table_offset", "block_ids", "copies")
        return "AppendResult(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in fields) + ")"


Column = list[int] | npt.NDArray[np.int64]  # a column as given: a list, or an array turned into one when first read


class AppendBatch:
    """What one batched append changed, column by column: entry i describes `seq_ids[i]`.

    The one result of an append; `results()` (and a single `append`) read rows of it through
    `AppendResult`. Sequence i's `block_table[table_offsets[i]:]` is now its run of
    `num_block_ids[i]` entries of `block_ids`. `slots` holds every appended token's slot in request
    order (the step's slot mapping, [total appended tokens]). Apply `copies` (src_block, dst_block,
    index of the sequence) before writing slots.

    The core computes its columns as arrays and each becomes a list when first read (a decode loop whose
    worker reads only `slots` and `copies` never pays for the rest); the client passes lists.
    """

    __slots__ = (
        "seq_ids",
        "num_appended",
        "_num_tokens",
        "_table_offsets",
        "_num_block_ids",
        "_block_ids",
        "copies",
        "slot_source",
        "offloads",
    )

    def __init__(
        self,
        *,
        seq_ids: list[int],
        num_appended: list[int],
        num_tokens: Column,
        table_offsets: Column,
        num_block_ids: Column,
        block_ids: list[int] | npt.NDArray[np.int32],
        copies: list[tuple[int, int, int]],
        slot_source: SlotPlan | npt.NDArray[np.int64],
        offloads: Pairs = NO_PAIRS,
    ) -> None:
        self.seq_ids, self.num_appended = seq_ids, num_appended  # tokens appended to each sequence
        self._num_tokens, self._table_offsets, self._num_block_ids = num_tokens, table_offsets, num_block_ids
        self._block_ids = block_ids
        self.copies = copies
        self.slot_source = slot_source  # the slots, or what they follow from
        self.offloads = offloads  # host tier: int64 [n, 2] (device_block, host_block), applied before `copies`

    @property
    def num_tokens(self) -> list[int]:
        """Sequence lengths after the append."""
        if isinstance(self._num_tokens, list):
            return self._num_tokens
        values: list[int] = self._num_tokens.tolist()
        self._num_tokens = values
        return values

    @property
    def table_offsets(self) -> list[int]:
        if isinstance(self._table_offsets, list):
            return self._table_offsets
        values: list[int] = self._table_offsets.tolist()
        self._table_offsets = values
        return values

    @property
    def num_block_ids(self) -> list[int]:
        if isinstance(self._num_block_ids, list):
            return self._num_block_ids
        values: list[int] = self._num_block_ids.tolist()
        self._num_block_ids = values
        return values

    @property
    def block_ids(self) -> list[int]:
        if isinstance(self._block_ids, list):
            return self._block_ids
        values: list[int] = self._block_ids.tolist()
        self._block_ids = values
        return values

    def __repr__(self) -> str:
        names = ("seq_ids", "num_appended", "num_tokens", "table_offsets", "num_block_ids", "block_ids", "copies")
        return "AppendBatch(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in names) + ")"

    @property
    def slots(self) -> npt.NDArray[np.int64]:
        return as_slots(self.slot_source)

    def copy_pairs(self) -> npt.NDArray[np.int64]:
        """`copies` as int64 `[n, 2]` (src_block, dst_block): `copy_blocks`' `pairs`."""
        return copy_pairs(self.copies)

    def step_arrays(self, block_table: BlockTableOf) -> StepArrays:
        """The step for the worker: slots, copy pairs, padded tables and lengths (see `StepArrays.from_append`)."""
        return StepArrays.from_append(self, block_table)

    def results(self) -> list[AppendResult]:
        """The same, one row per sequence."""
        out, block_start, slot_start = [], 0, 0
        for i, (num_blocks, num_new) in enumerate(zip(self.num_block_ids, self.num_appended, strict=True)):
            out.append(AppendResult(self, i, block_start=block_start, slot_start=slot_start))
            block_start += num_blocks
            slot_start += num_new
        return out
