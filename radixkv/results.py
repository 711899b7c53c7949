"""What the core's calls return: plain records a scheduler reads (and the client rebuilds from the wire)."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from radixkv.handoff import BlockTableOf, StepArrays, copy_pairs


@dataclasses.dataclass(frozen=True, slots=True)
class SlotPlan:
    """What a batch's slots follow from: the table blocks each sequence's new tokens land in.

    Kept instead of the slots themselves, so a caller that never reads them (a scheduler whose
    workers derive slots from block tables) never pays for them. Serves one sequence (an open) or
    a batch (an append step) alike.
    """

    block_size: int
    span_blocks: list[int]  # per sequence in turn, the blocks its new tokens land in
    span_starts: list[int]  # each sequence's first new token, as a position within span_blocks
    counts: list[int]

    def slots(self) -> npt.NDArray[np.int64]:
        """slot of token j = span_blocks[p_j // block_size] * block_size + p_j % block_size."""
        bs = self.block_size
        counts = np.asarray(self.counts, dtype=np.int64)
        firsts = np.cumsum(counts) - counts
        positions = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(np.asarray(self.span_starts, dtype=np.int64) - firsts, counts)
        return np.asarray(self.span_blocks, dtype=np.int64)[positions // bs] * bs + positions % bs


class _SlotsOnFirstRead:
    """`slots` of a record that holds them as `slot_source`: the array, or the plan it follows from."""

    __slots__ = ()
    slot_source: SlotPlan | npt.NDArray[np.int64]

    @property
    def slots(self) -> npt.NDArray[np.int64]:
        if isinstance(self.slot_source, SlotPlan):
            self.slot_source = self.slot_source.slots()  # type: ignore[misc]  # the dataclass subclasses own the slot
        return self.slot_source


@dataclasses.dataclass(slots=True)
class OpenResult(_SlotsOnFirstRead):
    """`slots`: [num_tokens - num_cached_tokens], where the uncached tokens' K/V go."""

    seq_id: int
    num_cached_tokens: int  # prefix served from the cache: compute K/V only for the rest
    block_table: list[int]
    slot_source: SlotPlan | npt.NDArray[np.int64]  # the slots, or what they follow from

    def step_arrays(self) -> StepArrays:
        """This sequence's prefill for the worker (`StepArrays.from_opens` for a batch)."""
        return StepArrays.from_opens([self])


@dataclasses.dataclass(slots=True)
class AppendResult(_SlotsOnFirstRead):
    """What one append changed: `block_table[table_offset:]` is now `block_ids`.

    Apply `copies` (copy-on-write of a shared partial block) before writing `slots` ([num_appended]).
    """

    seq_id: int
    num_tokens: int  # sequence length after the append
    table_offset: int
    block_ids: list[int]
    copies: list[tuple[int, int]]
    slot_source: SlotPlan | npt.NDArray[np.int64]  # the slots, or what they follow from


@dataclasses.dataclass(slots=True)
class AppendBatch(_SlotsOnFirstRead):
    """What one batched append changed, column by column: entry i describes `seq_ids[i]`.

    Sequence i's `block_table[table_offsets[i]:]` is now its run of `num_block_ids[i]` entries of
    `block_ids`. `slots` holds every appended token's slot in request order (the step's slot
    mapping, [total appended tokens]). Apply `copies` (src_block, dst_block, index of the sequence) before writing slots.
    """

    seq_ids: list[int]
    num_appended: list[int]  # tokens appended to each sequence
    num_tokens: list[int]  # sequence lengths after the append
    table_offsets: list[int]
    num_block_ids: list[int]
    block_ids: list[int]
    copies: list[tuple[int, int, int]]
    slot_source: SlotPlan | npt.NDArray[np.int64]  # the slots, or what they follow from

    def copy_pairs(self) -> npt.NDArray[np.int64]:
        """`copies` as int64 `[n, 2]` (src_block, dst_block): `copy_blocks`' `pairs`."""
        return copy_pairs(self.copies)

    def step_arrays(self, block_table: BlockTableOf) -> StepArrays:
        """The step for the worker: slots, copy pairs, padded tables and lengths (see `StepArrays.from_append`)."""
        return StepArrays.from_append(self, block_table)

    def results(self) -> list[AppendResult]:
        """The same, one record per sequence."""
        out, b, t = [], 0, 0
        per_seq_copies: dict[int, list[tuple[int, int]]] = {}
        for src, dst, index in self.copies:
            per_seq_copies.setdefault(index, []).append((src, dst))
        for i, seq_id in enumerate(self.seq_ids):
            n_blocks, n_new = self.num_block_ids[i], self.num_appended[i]
            out.append(AppendResult(seq_id, self.num_tokens[i], self.table_offsets[i], self.block_ids[b : b + n_blocks], per_seq_copies.get(i, []), self.slots[t : t + n_new]))
            b += n_blocks
            t += n_new
        return out
