"""The registered sequences' hot fields in columns, one row per sequence, and their tails in one token arena.

A decode step appends one token to each of hundreds of sequences. Kept in per-sequence Python objects, each
field read or written costs a Python statement per sequence, which is most of a step; kept here, a batch reads
and writes them in a few numpy calls (vLLM's persistent batch keeps its requests the same way). They are the
only copy of what they hold while a sequence is registered (`LiveSequence` reads through). `col[field]` is a
field's int64 array, for batches; `cell[field]` a memoryview of the same memory, for one sequence at a time
(a third of what a numpy scalar access costs).

A tail (the tokens past a sequence's locked tree path) is `tokens[TAIL_START:TAIL_END]`, with room up to
`TAIL_LIMIT`. A full region moves to a new one twice its size at the arena's end; when the arena runs out, the
live regions are copied into a fresh one with as much room again (amortised O(1) per token, like a list's
growth). A released sequence's region is garbage until then.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixkv.tree.token_ids import TOKEN_BYTES

# A row's fields.
TOKENS = 0  # the sequence's length
COMPUTED = 1  # its computed watermark
LAST = 2  # its block table's last block (-1: an empty table)
RESERVE = 3  # the table length its admission reserved growth up to (0: none)
TAIL_START, TAIL_END, TAIL_LIMIT = 4, 5, 6  # its tail's region in `tokens`
_FIELDS = 7

_INT32 = np.dtype("<i4")
_MIN_ROOM = 16  # tokens of room a new region gets past what it holds


class Columns:
    """Rows of the fields above, and the token arena; rows are reused."""

    __slots__ = ("col", "cell", "used", "tokens", "_end", "_free", "_marks", "_order")

    def __init__(self, capacity: int = 64, arena_tokens: int = 4096) -> None:
        self.col = [np.zeros(capacity, dtype=np.int64) for _ in range(_FIELDS)]  # col[field]: [rows]
        self.cell = [c.data for c in self.col]  # the same memory, one int at a time
        self.used = np.zeros(capacity, dtype=bool)
        self.tokens = np.zeros(arena_tokens, dtype=_INT32)  # the tails' regions, and garbage between them
        self._end = 0  # where the next region starts
        self._free = list(range(capacity - 1, -1, -1))
        self._marks = np.zeros(capacity, dtype=np.intp)  # scratch for `distinct`
        self._order = np.arange(capacity, dtype=np.intp)

    def take(self, tail: bytes) -> int:
        """A row for a new sequence whose tail is `tail` (int32 bytes); its other fields are the caller's to set."""
        n = len(tail) // TOKEN_BYTES
        row = self._row()
        start = self._region(row, n, n + max(_MIN_ROOM, n >> 2))
        self.tokens[start : start + n] = np.frombuffer(tail, dtype=_INT32)
        return row

    def copy(self, row: int) -> int:
        """A new row with `row`'s length, watermark and last block, a copy of its tail, and no reservation (a
        fork's child: the per-field stores spelled out, as a beam search forks every step)."""
        new = self._row()
        cell = self.cell  # read after `_row`: it may grow the columns
        starts, ends, limits = cell[TAIL_START], cell[TAIL_END], cell[TAIL_LIMIT]
        n = ends[row] - starts[row]
        capacity = n + _MIN_ROOM
        if self._end + capacity > len(self.tokens):
            self._compact(capacity)
        src, dst = starts[row], self._end
        self._end = dst + capacity
        self.tokens[dst : dst + n] = self.tokens[src : src + n]
        starts[new], ends[new], limits[new] = dst, dst + n, dst + capacity
        tokens, computed, last, reserve = cell[TOKENS], cell[COMPUTED], cell[LAST], cell[RESERVE]
        tokens[new], computed[new], last[new], reserve[new] = tokens[row], computed[row], last[row], 0
        return new

    def _row(self) -> int:
        """A free row, its tail region empty."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.used[row] = True
        cell = self.cell
        cell[TAIL_START][row] = cell[TAIL_END][row] = cell[TAIL_LIMIT][row] = 0
        return row

    def _region(self, row: int, length: int, capacity: int) -> int:
        """Point `row`'s tail at a fresh region of `capacity` tokens at the arena's end, holding `length` tokens
        the caller writes there; returns where it starts."""
        if self._end + capacity > len(self.tokens):
            self._compact(capacity)
        start = self._end
        self._end = start + capacity
        cell = self.cell
        cell[TAIL_START][row], cell[TAIL_END][row], cell[TAIL_LIMIT][row] = start, start + length, start + capacity
        return start

    def distinct(self, rows: npt.NDArray[np.intp]) -> bool:
        """Whether no row appears twice in `rows`: each writes its position, and a repeat overwrites one."""
        order = self._order[: len(rows)]
        self._marks[rows] = order
        return bool((self._marks[rows] == order).all())

    def give_back(self, row: int) -> None:
        self.used[row] = False
        self._free.append(row)

    def tail(self, row: int, num_tokens: int | None = None) -> bytes:
        """The first `num_tokens` tokens of the row's tail (all of it: None), as int32 bytes."""
        start, end = self.cell[TAIL_START][row], self.cell[TAIL_END][row]
        return self.tokens[start : end if num_tokens is None else min(end, start + num_tokens)].tobytes()

    def trim_tail(self, row: int, num_tokens: int) -> None:
        """Drop the first `num_tokens` tokens of the row's tail (the tree holds them now)."""
        self.cell[TAIL_START][row] += num_tokens

    def extend_tail(self, row: int, data: bytes | memoryview) -> None:
        """Append `data` (int32 bytes) to one row's tail."""
        n, ends = len(data) // TOKEN_BYTES, self.cell[TAIL_END]
        if ends[row] + n > self.cell[TAIL_LIMIT][row]:
            self._move(row, 2 * (ends[row] - self.cell[TAIL_START][row] + n) + _MIN_ROOM)
        end = ends[row]
        self.tokens[end : end + n] = np.frombuffer(data, dtype=_INT32)
        ends[row] = end + n

    def append_tokens(self, rows: npt.NDArray[np.intp], tokens: npt.NDArray[np.int32]) -> None:
        """Append `tokens[i]` to the tail of `rows[i]` (distinct rows): a decode step's tokens, in one write."""
        ends = self.col[TAIL_END][rows]
        full = ends >= self.col[TAIL_LIMIT][rows]
        if full.any():  # a few regions move (and maybe the whole arena) before the write
            for row in rows[full].tolist():
                self._move(row, 2 * (self.cell[TAIL_END][row] - self.cell[TAIL_START][row]) + _MIN_ROOM)
            ends = self.col[TAIL_END][rows]
        self.tokens[ends] = tokens
        self.col[TAIL_END][rows] = ends + 1

    def _move(self, row: int, capacity: int) -> None:
        """Give the row's tail a region of `capacity` tokens at the arena's end, its tokens copied over."""
        n = self.cell[TAIL_END][row] - self.cell[TAIL_START][row]
        if self._end + capacity > len(self.tokens):
            self._compact(capacity)
        src = self.cell[TAIL_START][row]  # read after the compaction
        dst = self._region(row, n, capacity)
        self.tokens[dst : dst + n] = self.tokens[src : src + n]

    def _compact(self, room: int) -> None:
        """Copy every live tail into a fresh arena, in row order, leaving at least `room` tokens after them and as
        many free as live (so compactions are far apart)."""
        rows = np.flatnonzero(self.used)
        starts, ends, limits = (self.col[field][rows] for field in (TAIL_START, TAIL_END, TAIL_LIMIT))
        caps = limits - starts
        live = int(caps.sum())
        fresh = np.zeros(max(len(self.tokens), 2 * (live + room)), dtype=_INT32)
        new_starts = np.cumsum(caps) - caps
        for old, new, n in zip(starts.tolist(), new_starts.tolist(), (ends - starts).tolist(), strict=True):
            fresh[new : new + n] = self.tokens[old : old + n]
        self.tokens, self._end = fresh, live
        self.col[TAIL_START][rows], self.col[TAIL_END][rows] = new_starts, new_starts + ends - starts
        self.col[TAIL_LIMIT][rows] = new_starts + caps

    def _grow_rows(self) -> None:
        """Double the rows (amortised O(1) per sequence)."""
        n = len(self.used)
        for view in self.cell:
            view.release()
        self.col = [np.concatenate((c, np.zeros(n, dtype=np.int64))) for c in self.col]
        self.cell = [c.data for c in self.col]
        self.used = np.concatenate((self.used, np.zeros(n, dtype=bool)))
        self._marks, self._order = np.zeros(2 * n, dtype=np.intp), np.arange(2 * n, dtype=np.intp)
        self._free = list(range(2 * n - 1, n - 1, -1))
