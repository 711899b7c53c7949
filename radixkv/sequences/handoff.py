"""The worker hand-off: one step's slots, copies, block tables and lengths as arrays shaped for the kernels.

The core answers column by column (slots, copy triples, table deltas); a worker wants what
`store_kv`, `copy_blocks` and `paged_decode_attention` take. `StepArrays` is that, in numpy: no
torch here, and it pickles, so an orchestrator can send it to a worker process, whose one call
`radixkv.kernels.step_tensors(arrays, device)` puts it on its device.

Sequence ids are int64 end to end (the core issues positive ids below 2^63; the wire carries uint64).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

BlockTableOf = Callable[[int], Sequence[int]]  # seq_id -> its whole block table (`client.block_table`)


class Opened(Protocol):
    """What a prefill step reads of an opened sequence (`radixkv.sequences.results.OpenResult`)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def block_table(self) -> npt.NDArray[np.int32]: ...
    @property
    def slots(self) -> npt.NDArray[np.int64]: ...


class Appended(Protocol):
    """What a decode step reads of an append (`radixkv.sequences.results.AppendBatch`)."""

    @property
    def seq_ids(self) -> list[int]: ...
    @property
    def num_appended(self) -> list[int]: ...
    @property
    def num_tokens(self) -> list[int]: ...
    @property
    def slots(self) -> npt.NDArray[np.int64]: ...
    @property
    def copies(self) -> list[tuple[int, int, int]]: ...


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepArrays:
    """What a worker applies for one step, in this order: `copies`, then K/V into `slots`, then attention.

    Row i describes `seq_ids[i]`; its new tokens are `slots[query_starts[i]:query_starts[i + 1]]`.
    `block_tables` rows are padded with 0 past `ceil(seq_lens[i] / block_size)` entries, which the
    kernels never read.
    """

    seq_ids: npt.NDArray[np.int64]  # [num_seqs]
    query_starts: npt.NDArray[np.int32]  # [num_seqs + 1] cumulative new tokens (vLLM's query_start_loc)
    slots: npt.NDArray[np.int64]  # [num_new_tokens] slot = block_id * block_size + offset
    copies: npt.NDArray[np.int64]  # [num_copies, 2] (src_block, dst_block), copy_blocks' `pairs`
    block_tables: npt.NDArray[np.int32]  # [num_seqs, max_blocks_per_seq]
    seq_lens: npt.NDArray[np.int32]  # [num_seqs] tokens each sequence holds after the step

    @property
    def num_new_tokens(self) -> npt.NDArray[np.int32]:
        """[num_seqs] tokens each sequence writes this step."""
        return np.diff(self.query_starts).astype(np.int32)

    @classmethod
    def from_opens(cls, results: Sequence[Opened]) -> StepArrays:
        """A prefill step: every opened sequence writes its uncached tokens."""
        slots = [r.slots for r in results]
        counts = [len(s) for s in slots]
        return cls(
            seq_ids=np.array([r.seq_id for r in results], dtype=np.int64),
            query_starts=_starts(counts),
            slots=np.concatenate(slots).astype(np.int64, copy=False) if slots else np.empty(0, np.int64),
            copies=np.empty((0, 2), np.int64),
            block_tables=padded_block_tables([r.block_table for r in results]),
            seq_lens=np.array([r.num_cached_tokens + n for r, n in zip(results, counts, strict=True)], dtype=np.int32),
        )

    @classmethod
    def from_append(cls, batch: Appended, block_table: BlockTableOf) -> StepArrays:
        """A decode (or chunked-prefill) step; `block_table` gives tables as they stand after the append.

        Pass `RadixKVClient.block_table` or `KVCache.block_table`: both reflect the batch once it returns.
        """
        return cls(
            seq_ids=np.array(batch.seq_ids, dtype=np.int64),
            query_starts=_starts(batch.num_appended),
            slots=batch.slots,
            copies=copy_pairs(batch.copies),
            block_tables=padded_block_tables([block_table(s) for s in batch.seq_ids]),
            seq_lens=np.array(batch.num_tokens, dtype=np.int32),
        )

    @classmethod
    def concat(cls, parts: Sequence[StepArrays]) -> StepArrays:
        """One step from several (a step that prefills new sequences and decodes the others)."""
        if not parts:
            return cls.from_opens([])
        width = max(p.block_tables.shape[1] for p in parts)
        tables = [np.pad(p.block_tables, ((0, 0), (0, width - p.block_tables.shape[1]))) for p in parts]
        counts = np.concatenate([p.num_new_tokens for p in parts])
        return cls(
            seq_ids=np.concatenate([p.seq_ids for p in parts]),
            query_starts=_starts(counts.tolist()),
            slots=np.concatenate([p.slots for p in parts]),
            copies=np.concatenate([p.copies for p in parts]),
            block_tables=np.concatenate(tables),
            seq_lens=np.concatenate([p.seq_lens for p in parts]),
        )


def padded_block_tables(tables: Sequence[Sequence[int] | npt.NDArray[np.int32]]) -> npt.NDArray[np.int32]:
    """int32 `[len(tables), longest]`, each row a table (a list or an int32 array) followed by zeros."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))  # [num_seqs]
    width = int(lengths.max(initial=0))
    out = np.zeros((len(tables), width), dtype=np.int32)
    # One scatter of every id in row order, rather than a Python-level copy per row.
    rows = [np.asarray(t, dtype=np.int32) for t in tables]
    out[np.arange(width) < lengths[:, None]] = np.concatenate([np.empty(0, np.int32), *rows])
    return out


def copy_pairs(copies: Sequence[Sequence[int]]) -> npt.NDArray[np.int64]:
    """int64 `[n, 2]` (src_block, dst_block) from pairs or from `AppendBatch.copies` triples."""
    if len(copies) == 0:
        return np.empty((0, 2), np.int64)
    return np.array([(c[0], c[1]) for c in copies], dtype=np.int64)


def _starts(counts: Sequence[int]) -> npt.NDArray[np.int32]:
    out = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=out[1:])
    return out
