"""A sequence's block table: an int32 buffer with room to grow, so no step costs a Python loop per block.

Opening a sequence concatenates its cached path's node arrays and its new blocks in one call;
appending a block writes one entry (the buffer doubles when full, amortised O(1)); reading the
table is a slice. What the table hands out (`array()`) is a read-only view, never copied: entries
below the length are rewritten only by copy-on-write of the last block (`set_last`), which first
moves the buffer when a view is out, so every view stays the snapshot it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]


class BlockTable:
    """`length` block ids in `_buffer[:length]`; `_buffer[length:]` is room for the next appends.

    A decode step reads every sequence's length and last block, and most sequences get no block:
    both are plain attributes (`last` is -1 for an empty table), so the step touches neither the
    buffer nor a method per sequence. A server step runs after an idle wait, when every line it
    touches comes from memory (bench_service's cadence rows).
    """

    __slots__ = ("_buffer", "length", "last", "_shared")

    def __init__(self, buffer: Int32Array, length: int) -> None:
        self._buffer = buffer  # [capacity] int32, owned by this table
        self.length = length
        self.last = int(buffer[length - 1]) if length else -1
        self._shared = False  # a view of the first `length` entries is out: rewrite none of them in place

    @classmethod
    def of(cls, parts: Sequence[npt.NDArray[np.int32]]) -> BlockTable:
        """The concatenation of `parts`, with room for a quarter more blocks (at least 16)."""
        length = sum(len(p) for p in parts)
        buffer = np.empty(length + max(16, length >> 2), dtype=np.int32)
        if parts:
            np.concatenate(parts, out=buffer[:length])
        return cls(buffer, length)

    def __len__(self) -> int:
        return self.length

    def array(self) -> Int32Array:
        """The table as a read-only int32 view: later appends and copy-on-write leave it as it is."""
        view = self._buffer[: self.length]
        view.flags.writeable = False
        self._shared = True
        return view

    def __getitem__(self, index: slice) -> Int32Array:
        """A view of a range, for the caller to use at once (the core's own reads)."""
        start, stop, _ = index.indices(self.length)
        return self._buffer[start:stop]

    def at(self, index: int) -> int:
        """The block at `index` (below the length)."""
        block_id: int = self._buffer.item(index)
        return block_id

    def extend(self, block_ids: Int32Array) -> None:
        n = len(block_ids)
        end = self.length + n
        if end > len(self._buffer):
            self._grow(end)
        self._buffer[self.length : end] = block_ids
        self.length = end
        if n:
            self.last = int(block_ids[-1])

    def append(self, block_id: int) -> None:
        """One more block (a decode step's new one): `extend` without an array."""
        if self.length == len(self._buffer):
            self._grow(self.length + 1)
        self._buffer[self.length] = block_id
        self.length += 1
        self.last = block_id

    def _grow(self, end: int) -> None:
        """Move to a buffer with room for `end` entries, doubling (at least 16): amortised O(1) per block."""
        grown = np.empty(max(end, 16, 2 * len(self._buffer)), dtype=np.int32)
        grown[: self.length] = self._buffer[: self.length]
        self._buffer, self._shared = grown, False

    def set_last(self, block_id: int) -> None:
        """Replace the last block (copy-on-write); moves the buffer first if a view of it is out."""
        if self._shared:
            self._buffer, self._shared = self._buffer.copy(), False
        self._buffer[self.length - 1] = block_id
        self.last = int(block_id)

    def copy(self) -> BlockTable:
        """An independent table with the same blocks (a forked child's)."""
        table = BlockTable.__new__(BlockTable)
        table._buffer, table.length, table.last, table._shared = self._buffer.copy(), self.length, self.last, False
        return table

    def tolist(self) -> list[int]:
        block_ids: list[int] = self._buffer[: self.length].tolist()
        return block_ids
