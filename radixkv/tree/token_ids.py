"""Token ids as the core keeps them: little-endian int32 bytes, so prefixes compare with one memcmp."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, LimitExceeded

TOKEN_BYTES = 4
MAX_TOKEN_ID = 2**31 - 1

_INT32 = np.dtype("<i4")

TokenIds = Sequence[int] | npt.NDArray[np.integer] | bytes


def to_token_bytes(token_ids: TokenIds, field: str = "token_ids", *, allow_empty: bool = False) -> bytes:
    """Validate token ids (integers in [0, 2^31)) and pack them as int32 bytes.

    Raises:
        InvalidArgument: naming `field`, for an empty list, non-integers or ids out of range.
    """
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == _INT32 and token_ids.ndim == 1 and token_ids.size:
        # The hot path (a scheduler's arrays): int32 cannot exceed the maximum, so one pass checks it.
        if token_ids.min() < 0:
            raise InvalidArgument(field, f"token ids must lie in [0, {MAX_TOKEN_ID}]")
        return token_ids.tobytes()
    if type(token_ids) is list and token_ids:  # a tokenizer's or sampler's list: packed in one C call
        try:
            data = struct.pack(f"<{len(token_ids)}I", *token_ids)  # unsigned: a negative id does not pack
        except struct.error:
            pass  # not all integers in [0, 2^32): the general path below names what is wrong
        else:
            if np.frombuffer(data, dtype=_INT32).min() < 0:  # an id of 2^31 or more reads as negative
                raise InvalidArgument(field, f"token ids must lie in [0, {MAX_TOKEN_ID}]")
            return data
    if isinstance(token_ids, bytes):
        if len(token_ids) % TOKEN_BYTES:
            raise InvalidArgument(field, f"packed token ids must be a multiple of {TOKEN_BYTES} bytes")
        array = np.frombuffer(token_ids, dtype="<i4")
    else:
        try:
            array = np.asarray(token_ids)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(field, f"not a list of integers ({e})") from None
        if array.ndim != 1:
            raise InvalidArgument(field, f"must be a flat list of integers, got shape {array.shape}")
        if array.size and array.dtype.kind not in "iu":
            raise InvalidArgument(field, f"must be integers, got {array.dtype}")
    if array.size == 0:
        if allow_empty:
            return b""
        raise InvalidArgument(field, "must not be empty")
    if int(array.min()) < 0 or (array.dtype.itemsize > 4 and int(array.max()) > MAX_TOKEN_ID):  # int32: never past
        raise InvalidArgument(field, f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    if isinstance(token_ids, bytes):
        return token_ids
    return array.astype("<i4", copy=False).tobytes()


class TokenKey:
    """Validated token ids as little-endian int32 bytes: the form the radix tree compares with one memcmp.

    Owns the arithmetic between token counts and byte offsets, so the core never multiplies by
    TOKEN_BYTES itself.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data  # already validated: use `TokenKey.of` for a caller's token ids

    @classmethod
    def of(cls, token_ids: TokenIds, field: str = "token_ids", *, max_tokens: int | None = None) -> TokenKey:
        """Raises InvalidArgument naming `field` (see `to_token_bytes`), LimitExceeded past `max_tokens`."""
        key = cls(to_token_bytes(token_ids, field))
        if max_tokens is not None and key.num_tokens > max_tokens:
            raise LimitExceeded("max_tokens_per_request", key.num_tokens, max_tokens)
        return key

    @property
    def num_tokens(self) -> int:
        return len(self.data) // TOKEN_BYTES

    def whole_blocks(self, block_size: int) -> int:
        """How many full blocks of `block_size` tokens these tokens fill."""
        return self.num_tokens // block_size

    def head(self, num_tokens: int) -> bytes:
        """The bytes of the first `num_tokens` tokens."""
        return self.data[: num_tokens * TOKEN_BYTES]

    def tail_after(self, num_tokens: int) -> bytes:
        """The bytes of every token after the first `num_tokens`."""
        return self.data[num_tokens * TOKEN_BYTES :]

    def whole_block_prefix(self, block_size: int) -> bytes:
        """The bytes of the tokens that fill whole blocks (what a pin or a match can cover)."""
        return self.head(self.whole_blocks(block_size) * block_size)

    @staticmethod
    def num_bytes(num_tokens: int) -> int:
        """Byte length of `num_tokens` tokens (for slicing a sequence's tail bytes)."""
        return num_tokens * TOKEN_BYTES

    @staticmethod
    def count(data: bytes | bytearray | memoryview) -> int:
        """How many tokens `data` holds."""
        return len(data) // TOKEN_BYTES


def from_token_bytes(data: bytes | bytearray) -> list[int]:
    token_ids: list[int] = np.frombuffer(bytes(data), dtype="<i4").tolist()
    return token_ids


def common_blocks(key: bytes, pos: int, end: int, run: bytes, block_size: int) -> int:
    """Whole blocks at the start of `run` equal to `key[pos:end]`: where a prefix match ending inside a tree
    node (device or host) stops."""
    n = min(len(run), end - pos) // TOKEN_BYTES
    ours = np.frombuffer(key, dtype="<i4", count=n, offset=pos)
    differ = np.flatnonzero(ours != np.frombuffer(run, dtype="<i4", count=n))
    return (int(differ[0]) if differ.size else n) // block_size
