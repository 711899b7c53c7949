"""The live sequences' decode state in columns: one row per sequence, one array per field.

A decode step appends a token to each of hundreds of sequences, and most of them get no block. Kept
in objects, that state is spread over a few cache lines per sequence, and a server's step runs
right after an idle wait, when every one of them comes back from memory. Kept in arrays, the step
gathers and scatters a few kilobytes with numpy calls and touches a sequence's objects only when
its table grows.

The token ids live by slot (`tokens`, one int32 per slot of the pool, as the K/V does): a token's
id sits where its K/V goes, so a batch writes its ids with the slot mapping it already computed, and
a sequence's tokens past its locked path are its tail blocks' rows. A block's row is rewritten only
by a holder that owns it alone, so the rows of a block shared by a fork family agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from radixkv.sequence import LiveSequence

Int64Array = npt.NDArray[np.int64]


class SequenceColumns:
    """Rows of `num_tokens`, `num_computed`, `reserve_until` and `last_block` (the table's last entry, -1
    when empty), and `owner[row]`, the sequence a row describes; a freed row is reused."""

    def __init__(self, num_blocks: int, block_size: int, capacity: int = 64) -> None:
        self.block_size = block_size
        self.num_tokens = np.zeros(capacity, dtype=np.int64)
        self.num_computed = np.zeros(capacity, dtype=np.int64)
        self.reserve_until = np.zeros(capacity, dtype=np.int64)
        self.last_block = np.full(capacity, -1, dtype=np.int64)
        self.marks = np.zeros(capacity, dtype=np.int64)  # scratch: a batch's duplicate check
        self.num_blocks = num_blocks
        self.tokens = np.empty(0, dtype="<i4")  # token ids by slot, for the blocks below `len(by_block)`
        self.by_block = self.tokens.reshape(0, block_size)  # the same, a row per block
        self.owner: list[LiveSequence | None] = [None] * capacity
        self._free_rows = list(range(capacity - 1, -1, -1))

    def take_row(self, num_tokens: int, num_computed: int, reserve_until: int, last_block: int) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.num_tokens[row], self.num_computed[row] = num_tokens, num_computed
        self.reserve_until[row], self.last_block[row] = reserve_until, last_block
        return row

    def free_row(self, row: int) -> None:
        self.owner[row] = None
        self._free_rows.append(row)

    def num_rows_used(self) -> int:
        return len(self.owner) - len(self._free_rows)

    def write_tokens(self, block_ids: npt.NDArray[np.int32], token_bytes: bytes, start: int = 0) -> None:
        """Token ids (int32 LE bytes) into the rows of `block_ids`, from slot `start` of the first."""
        ids, bs = np.frombuffer(token_bytes, dtype="<i4"), self.block_size
        if not len(ids):
            return
        blocks = block_ids[: -(-(start + len(ids)) // bs)]
        if _is_run(blocks):  # blocks taken together are mostly consecutive: one slice
            begin = int(blocks[0]) * bs + start
            if begin + len(ids) > len(self.tokens):
                self.cover(int(blocks[-1]))
            self.tokens[begin : begin + len(ids)] = ids
            return
        try:
            self._write_rows(blocks, ids, start)
        except IndexError:  # a block past the rows so far (rarely: see `cover`)
            self.cover(int(blocks.max()))
            self._write_rows(blocks, ids, start)

    def _write_rows(self, block_ids: npt.NDArray[np.int32], ids: npt.NDArray[np.int32], start: int) -> None:
        bs = self.block_size
        if bs == 1:  # a block per token: flat, as a per-row copy of one id costs numpy ~10x more
            self.tokens[block_ids] = ids
            return
        if start:
            head = min(bs - start, len(ids))
            self.by_block[block_ids[0], start : start + head] = ids[:head]
            ids, block_ids = ids[head:], block_ids[1:]
        num_full, rest = divmod(len(ids), bs)
        if num_full:
            self.by_block[block_ids[:num_full]] = ids[: num_full * bs].reshape(num_full, bs)
        if rest:
            self.by_block[block_ids[num_full], :rest] = ids[num_full * bs :]

    def write_slots(self, slots: Int64Array, token_bytes: bytes) -> None:
        """Token ids (int32 LE bytes) at `slots`, one each (a decode step's)."""
        try:
            self.tokens[slots] = np.frombuffer(token_bytes, dtype="<i4")
        except IndexError:
            self.cover(int(slots.max()) // self.block_size)
            self.tokens[slots] = np.frombuffer(token_bytes, dtype="<i4")

    def read_tokens(self, block_ids: npt.NDArray[np.int32], num_tokens: int) -> bytes:
        """The first `num_tokens` token ids of the rows of `block_ids`, as int32 LE bytes."""
        if _is_run(block_ids):
            begin = int(block_ids[0]) * self.block_size
            return self.tokens[begin : begin + num_tokens].tobytes()
        data = (self.tokens if self.block_size == 1 else self.by_block)[block_ids].tobytes()
        return data if len(data) == 4 * num_tokens else data[: 4 * num_tokens]

    def cover(self, block_id: int) -> None:
        """Rows for every block up to `block_id`: the arena grows with the block ids sequences write (an
        empty pool holds none; the pool's free stack hands out low ids first). A write past the rows
        raises IndexError, and grows them then: no check on the way of every write."""
        if block_id >= len(self.by_block):
            num_rows = min(self.num_blocks, max(block_id + 1, 2 * len(self.by_block), 1024))
            tokens = np.empty(num_rows * self.block_size, dtype="<i4")
            tokens[: len(self.tokens)] = self.tokens
            self.tokens, self.by_block = tokens, tokens.reshape(num_rows, self.block_size)

    def copy_block(self, src: int, dst: int) -> None:
        """A copy-on-write's token ids: `dst`'s row becomes `src`'s (before anyone writes `src` again)."""
        if dst >= len(self.by_block):
            self.cover(dst)
        self.by_block[dst] = self.by_block[src]

    def copy(self) -> SequenceColumns:
        """The rows as they are now, without the token ids (the online audit's image needs none)."""
        image = SequenceColumns(self.num_blocks, self.block_size, 0)
        for name in ("num_tokens", "num_computed", "reserve_until", "last_block", "marks"):
            setattr(image, name, getattr(self, name).copy())
        image.owner, image._free_rows = list(self.owner), list(self._free_rows)
        return image

    def _grow(self) -> None:
        old = len(self.owner)
        new = max(64, 2 * old)
        for name in ("num_tokens", "num_computed", "reserve_until", "last_block", "marks"):
            grown = np.zeros(new, dtype=np.int64)
            grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        self.owner.extend([None] * (new - old))
        self._free_rows.extend(range(new - 1, old - 1, -1))


def _is_run(block_ids: npt.NDArray[np.int32]) -> bool:
    """Whether the blocks are consecutive ids, ascending (and at least one)."""
    n = len(block_ids)
    if not n or int(block_ids[-1]) - int(block_ids[0]) != n - 1:
        return False
    return n < 3 or bool((np.diff(block_ids) == 1).all())
