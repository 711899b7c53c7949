"""Live sequences: what each one holds, how far its K/V is written, and the registry that names them.

The computed watermark (`num_computed_tokens`): only full blocks below it are ever cached (by
`cache`, `release(cache=True)` and `fork`), so a later request never hits K/V the worker has not
written. `append` raises it to the tokens before the appended ones; `commit` raises it for the rest
(after a prefill, before caching, forking or releasing a sequence whose last tokens are written).

A decode step reads and writes a few fields of hundreds of sequences at once: each one's length, watermark,
last block and tail. Those live in the registry's columns (`radixkv.sequences.sequence`, a row per live
sequence), their only copy while the sequence is registered, so a step reads and writes them with a numpy
call each for the whole batch. A sequence not registered (being built, or the audit's copy) keeps them in its
own fields. Each sequence's block table (`BlockTable`) is here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, SequencePreempted, UnknownSequence
from radixkv.memory.block_pool import SMALL_BATCH
from radixkv.tree.radix_tree import TOKEN_BYTES, Node

# -- from memory/block_table.py (merged, issue 41: one concept, one module):
# A sequence's block table: an int32 buffer with room to grow, so no step costs a Python loop per block.
#
# Opening a sequence concatenates its cached path's node arrays and its new blocks in one call;
# appending a block writes one entry (the buffer doubles when full, amortised O(1)); reading the
# table is a slice. What the table hands out (`array()`) is a read-only view, never copied: entries
# below the length are rewritten only by copy-on-write of the last block (`set_last`), which first
# moves the buffer when a view is out, so every view stays the snapshot it was.

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


# -- from sequences/columns.py (merged, issue 41: one concept, one module):
# The registered sequences' hot fields in columns, one row per sequence, and their tails in one token arena.
#
# A decode step appends one token to each of hundreds of sequences. Kept in per-sequence Python objects, each
# field read or written costs a Python statement per sequence, which is most of a step; kept here, a batch reads
# and writes them in a few numpy calls (vLLM's persistent batch keeps its requests the same way). They are the
# only copy of what they hold while a sequence is registered (`LiveSequence` reads through). `col[field]` is a
# field's int64 array, for batches; `cell[field]` a memoryview of the same memory, for one sequence at a time
# (a third of what a numpy scalar access costs).
#
# A tail (the tokens past a sequence's locked tree path) is `tokens[TAIL_START:TAIL_END]`, with room up to
# `TAIL_LIMIT`. A full region moves to a new one twice its size at the arena's end; when the arena runs out, the
# live regions are copied into a fresh one with as much room again (amortised O(1) per token, like a list's
# growth). A released sequence's region is garbage until then.

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


class LiveSequence:
    """A sequence that holds blocks on the device (see the module docstring for where its hot fields live)."""

    __slots__ = (
        "seq_id",
        "namespace",
        "block_table",
        "lock_node",
        "num_tree_blocks",
        "private_prefix",
        "priority",
        "family",
        "row",
        "_columns",
        "_tail",
        "_num_tokens",
        "_num_computed",
        "_reserve_until",
    )

    def __init__(
        self,
        seq_id: int,
        *,
        namespace: str,
        tail: bytes,
        block_table: BlockTable,
        lock_node: Node,
        num_tree_blocks: int,
        private_prefix: npt.NDArray[np.int32],
        num_tokens: int,
        num_computed_tokens: int,
        priority: int = 0,
        reserve_until: int = 0,
    ) -> None:
        self.seq_id, self.namespace = seq_id, namespace
        self.block_table = block_table
        self.lock_node = lock_node  # deepest tree node on this sequence's prefix that it keeps locked (root: none)
        self.num_tree_blocks = num_tree_blocks  # leading blocks of the table that the locked path covers
        # Blocks this sequence holds by ref_count: the table past the locked path, plus its own copies of
        # locked-path blocks when the tree already held that prefix in other blocks (duplicates).
        self.private_prefix = private_prefix  # never written in place: replaced when it grows
        self.priority = priority  # victims go lowest priority first (see `radixkv.pressure.scheduling.victims`)
        # The live sequences forked from one another by id, this one included (one dict they all share; a release
        # leaves it in O(1), however wide the beam search), or None: only they can share blocks by count, and
        # `publish` moves all their holds on a block to the tree at once.
        self.family: dict[int, LiveSequence] | None = None
        self.row = -1  # its row in the registry's columns, once registered
        self._columns: Columns | None = None
        # While not registered: the tokens past the locked path (int32 bytes: all a sequence keeps of its
        # history, since the tree holds the rest), the length, the watermark, the reservation's end.
        self._tail, self._num_tokens, self._num_computed = bytes(tail), num_tokens, num_computed_tokens
        self._reserve_until = reserve_until

    @property
    def num_tokens(self) -> int:
        columns = self._columns
        return self._num_tokens if columns is None else columns.cell[TOKENS][self.row]

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V the worker has written (`commit`, or implied by the next `append`): only full blocks
        below this watermark are ever published to the tree."""
        columns = self._columns
        return self._num_computed if columns is None else columns.cell[COMPUTED][self.row]

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        if self._columns is None:
            self._num_computed = n
        else:
            self._columns.cell[COMPUTED][self.row] = n

    @property
    def reserve_until(self) -> int:
        """The table length its admission reserved growth up to (see `radixkv.sequences.admission`); blocks it appends
        below this draw on its reservation first. 0: no reservation."""
        columns = self._columns
        return self._reserve_until if columns is None else columns.cell[RESERVE][self.row]

    @property
    def last_block(self) -> int:
        """The table's last block as the columns hold it (a decode step reads it from there; -1: empty)."""
        return self.block_table.last if self._columns is None else self._columns.cell[LAST][self.row]

    def tail(self, num_tokens: int | None = None) -> bytes:
        """The first `num_tokens` tokens past the locked path (all of them: None), as int32 bytes."""
        if self._columns is None:
            return self._tail if num_tokens is None else self._tail[: num_tokens * TOKEN_BYTES]
        return self._columns.tail(self.row, num_tokens)

    def trim_tail(self, num_tokens: int) -> None:
        """The tree holds the first `num_tokens` tokens of the tail now (the locked path moved down over them)."""
        assert self._columns is not None, "only a registered sequence publishes"
        self._columns.trim_tail(self.row, num_tokens)

    def attach(self, columns: Columns) -> None:
        """Move the hot fields into a row of `columns` (they live only there from now on)."""
        row = columns.take(self._tail)
        cell = columns.cell
        cell[TOKENS][row], cell[COMPUTED][row] = self._num_tokens, self._num_computed
        cell[LAST][row], cell[RESERVE][row] = self.block_table.last, self._reserve_until
        self.row, self._columns, self._tail = row, columns, b""

    def retire(self) -> None:
        """Give the row back: the sequence has ended (released, or parked as a `PreemptedSequence`, which keeps
        what resuming needs). What it held is gone; it reads as holding nothing."""
        columns = self._columns
        assert columns is not None, "retire a registered sequence"
        columns.give_back(self.row)
        self.row, self._columns = -1, None
        self._tail, self._num_tokens, self._num_computed, self._reserve_until = b"", 0, 0, 0

    def private_blocks(self) -> npt.NDArray[np.int32]:
        """The blocks this sequence holds by count (a view or a fresh array: use it at once)."""
        own = self.block_table[self.num_tree_blocks :]
        return np.concatenate((self.private_prefix, own)) if len(self.private_prefix) else own

    def reservation(self) -> int:
        """Blocks still reserved for this sequence's growth: the rest of its admission's reservation."""
        return max(0, self.reserve_until - self.block_table.length)

    def image(self) -> LiveSequence:
        """An unregistered copy that later changes to this one leave alone (the online audit's), locking the
        same node."""
        return LiveSequence(
            self.seq_id,
            namespace=self.namespace,
            tail=self.tail(),
            block_table=self.block_table.copy(),
            lock_node=self.lock_node,
            num_tree_blocks=self.num_tree_blocks,
            private_prefix=self.private_prefix,
            num_tokens=self.num_tokens,
            num_computed_tokens=self.num_computed_tokens,
            priority=self.priority,
            reserve_until=self.reserve_until,
        )


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class PreemptedSequence:
    """A sequence that holds nothing on the device: its tokens, and what `resume` needs to bring it back."""

    seq_id: int
    namespace: str
    token_bytes: bytes  # every token (int32 LE)
    num_computed_tokens: int  # the watermark when preempted (a swap brings that K/V back)
    priority: int
    reserve_until: int
    mode: str  # "swap" or "recompute"
    host: object = None  # swap: what the host tier keeps for it (see `radixkv.pressure.preemption.SwapTier`)

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // 4


class Sequences:
    """The live sequences by id (their hot fields in `columns`, a row each), and the preempted ones apart; ids
    are never reused within one run."""

    def __init__(self, first_seq_id: int) -> None:
        self._rows: dict[int, int] = {}  # seq_id -> its row, in the order the sequences came
        self._at: list[LiveSequence | None] = []  # row -> its sequence
        self.columns = Columns()
        self.preempted: dict[int, PreemptedSequence] = {}
        self.next_seq_id = first_seq_id  # the id the next sequence gets (a snapshot keeps it)

    def next_id(self) -> int:
        seq_id = self.next_seq_id
        self.next_seq_id = seq_id + 1
        return seq_id

    def add(self, seq: LiveSequence) -> None:
        seq.attach(self.columns)
        self._place(seq)

    def _place(self, seq: LiveSequence) -> None:
        if seq.row >= len(self._at):
            self._at += [None] * (seq.row + 1 - len(self._at))
        self._rows[seq.seq_id], self._at[seq.row] = seq.row, seq

    def fork(self, parent: LiveSequence) -> LiveSequence:
        """Register a child of `parent` sharing every block (the caller adds its holds on them) and the priority;
        it reserves nothing, as its growth was never budgeted."""
        child = LiveSequence(
            self.next_id(),
            namespace=parent.namespace,
            tail=b"",
            block_table=parent.block_table.copy(),
            lock_node=parent.lock_node,
            num_tree_blocks=parent.num_tree_blocks,
            private_prefix=parent.private_prefix,
            num_tokens=0,
            num_computed_tokens=0,
            priority=parent.priority,
        )
        child.row, child._columns = self.columns.copy(parent.row), self.columns
        family = parent.family
        if family is None:
            family = parent.family = {parent.seq_id: parent}
        family[child.seq_id] = child
        child.family = family
        self._place(child)
        return child

    def remove(self, seq: LiveSequence) -> None:
        del self._rows[seq.seq_id]
        self._at[seq.row] = None
        family = seq.family
        if family is not None:
            del family[seq.seq_id]
            if len(family) == 1:
                next(iter(family.values())).family = None
            seq.family = None
        seq.retire()

    def at(self, row: int) -> LiveSequence:
        """The sequence registered in row `row`."""
        seq = self._at[row]
        assert seq is not None, f"row {row} holds no sequence"
        return seq

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[LiveSequence]:
        return map(self.at, list(self._rows.values()))

    def ids(self) -> list[int]:
        return list(self._rows)

    def get(self, seq_id: int, field: str = "seq_id") -> LiveSequence:
        """The live sequence `seq_id`, or the error naming `field`."""
        row = self._rows.get(seq_id) if isinstance(seq_id, int) else None
        if row is None:
            if not isinstance(seq_id, int) or isinstance(seq_id, bool):
                raise InvalidArgument(field, f"must be an integer, got {type(seq_id).__name__}")
            if seq_id in self.preempted:
                raise SequencePreempted(seq_id, field)
            raise UnknownSequence(seq_id)
        return self.at(row)

    def rows(self, seq_ids: Sequence[int]) -> npt.NDArray[np.intp]:
        """The rows of a batch's live sequences, each once, or the error naming the first bad entry."""
        n = len(seq_ids)
        try:  # a decode step's hundreds of ids: no Python-level loop when all are fine
            found = itemgetter(*seq_ids)(self._rows) if n > 1 else map(self._rows.__getitem__, seq_ids)
            rows: npt.NDArray[np.intp] | None = np.fromiter(found, np.intp, n)
        except (KeyError, TypeError):  # one is not live (or not hashable)
            rows = None
        if rows is None or type(sum(seq_ids)) is not int:  # 2.0 finds sequence 2 as a key, yet is refused
            for i, seq_id in enumerate(seq_ids):
                self.get(seq_id, f"seq_ids[{i}]")  # raises at the first entry that is not a live sequence's id
        assert rows is not None  # an entry not found raised above
        if n > 1 and not (len(set(seq_ids)) == n if n <= 16 else self.columns.distinct(rows)):
            raise InvalidArgument("seq_ids", "a sequence appears twice in one batch")
        return rows

    def batch(self, seq_ids: Sequence[int]) -> list[LiveSequence]:
        """The live sequences of a batch, each once, or the error naming the first bad entry."""
        return list(map(self.at, self.rows(seq_ids).tolist()))

    def for_release(self, seq_ids: Sequence[int]) -> tuple[list[LiveSequence], list[PreemptedSequence]]:
        """The live and the preempted sequences of a release batch (both may be released), each once."""
        if not self.preempted:  # the usual case: every one is live
            return ([self.get(seq_ids[0], "seq_ids[0]")] if len(seq_ids) == 1 else self.batch(seq_ids)), []
        live, parked = [], []
        for i, seq_id in enumerate(seq_ids):
            record = self.preempted.get(seq_id) if isinstance(seq_id, int) else None
            if record is None:
                live.append(self.get(seq_id, f"seq_ids[{i}]"))
            else:
                parked.append(record)
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument("seq_ids", "a sequence appears twice in one batch")
        return live, parked

    def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int], apply: bool = True) -> None:
        """Move each watermark to `num_tokens[i]` (with `apply`), or raise what doing so would raise.

        A few sequences (a request's) are checked and written one by one through the columns' memoryviews;
        a batch in numpy (each numpy call costs what the loop spends on several sequences, bench_core).
        """
        if len(num_tokens) != len(seq_ids):
            raise InvalidArgument(
                "num_tokens", f"needs one entry per seq_ids entry ({len(seq_ids)}), got {len(num_tokens)}"
            )
        rows = self.rows(seq_ids)
        if set(map(type, num_tokens)) - {int}:  # numpy ints pass; a bool or a float is named
            for i, n in enumerate(num_tokens):
                if not isinstance(n, int | np.integer) or isinstance(n, bool):
                    raise InvalidArgument(f"num_tokens[{i}]", f"must be an integer, got {type(n).__name__}")
        if len(rows) <= SMALL_BATCH:
            cell, row_list = self.columns.cell, rows.tolist()
            computed, tokens = cell[COMPUTED], cell[TOKENS]
            for i, (row, n) in enumerate(zip(row_list, num_tokens, strict=True)):
                if not computed[row] <= n <= tokens[row]:
                    self._refuse_commit(i, row, int(n))
            if apply:
                for row, n in zip(row_list, num_tokens, strict=True):
                    computed[row] = int(n)
            return
        wanted, col = np.array(num_tokens, dtype=np.int64), self.columns.col
        below, past = wanted < col[COMPUTED][rows], wanted > col[TOKENS][rows]
        if below.any() or past.any():
            i = int(np.argmax(below | past))
            self._refuse_commit(i, int(rows[i]), int(wanted[i]))
        if apply:
            col[COMPUTED][rows] = wanted

    def _refuse_commit(self, i: int, row: int, n: int) -> None:
        seq, field = self.at(row), f"num_tokens[{i}]"
        if n < seq.num_computed_tokens:
            raise InvalidArgument(field, f"{n} is below the {seq.num_computed_tokens} tokens already computed")
        raise InvalidArgument(field, f"{n} is past the sequence's {seq.num_tokens} tokens")


def path_runs(node: Node) -> list[npt.NDArray[np.int32]]:
    """The block arrays of the tree path ending at `node`, top-down: a locked sequence's table head.

    One entry per node, never a step per block; `np.concatenate` joins them.
    """
    runs = []
    while node.parent is not None:
        runs.append(node.block_ids)
        node = node.parent
    runs.reverse()
    return runs
