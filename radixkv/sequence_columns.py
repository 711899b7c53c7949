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
        self.tokens = np.empty(num_blocks * block_size, dtype="<i4")  # token ids by slot
        self.by_block = self.tokens.reshape(num_blocks, block_size)  # the same, a row per block
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

    def write_tokens(self, block_ids: npt.NDArray[np.int32], token_bytes: bytes) -> None:
        """Token ids (int32 LE bytes) into the rows of `block_ids`, from the first slot of the first."""
        ids, bs = np.frombuffer(token_bytes, dtype="<i4"), self.block_size
        num_full, rest = divmod(len(ids), bs)
        if num_full:
            self.by_block[block_ids[:num_full]] = ids[: num_full * bs].reshape(num_full, bs)
        if rest:
            self.by_block[block_ids[num_full], :rest] = ids[num_full * bs :]

    def read_tokens(self, block_ids: npt.NDArray[np.int32], num_tokens: int) -> bytes:
        """The first `num_tokens` token ids of the rows of `block_ids`, as int32 LE bytes."""
        data = self.by_block[block_ids].tobytes()
        return data if len(data) == 4 * num_tokens else data[: 4 * num_tokens]

    def copy_block(self, src: int, dst: int) -> None:
        """A copy-on-write's token ids: `dst`'s row becomes `src`'s (before anyone writes `src` again)."""
        bs = self.block_size
        self.tokens[dst * bs : (dst + 1) * bs] = self.tokens[src * bs : (src + 1) * bs]

    def copy(self) -> SequenceColumns:
        """The rows as they are now, without the token ids (the online audit's image needs none)."""
        image = SequenceColumns(0, self.block_size, 0)
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
