"""Integer columns as little-endian bytes: the Session stream's packed fields (`StepAppend.packed_seq_ids`, ...).

A decode step carries a few hundred ids, counts and lengths each way. `array.array` converts a
list of ints to bytes and back in one C loop each: about 3x faster than filling a protobuf repeated
field, and reading one back into a list is about 3x faster than `list(repeated_field)`.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

from radixkv.errors import InvalidArgument

_TYPECODES = {4: "I", 8: "Q"}  # bytes per value -> the unsigned array typecode of that width
assert all(array.array(code).itemsize == width for width, code in _TYPECODES.items()), "unusual C int widths"
_SWAP = sys.byteorder != "little"


def pack(values: Sequence[int], width: int) -> bytes:
    """Unsigned ints of `width` bytes (4 or 8), little-endian.

    Raises:
        TypeError, OverflowError: a value that is not an integer, or does not fit.
    """
    packed = array.array(_TYPECODES[width], values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes, width: int, field: str) -> list[int]:
    """The inverse of `pack`; InvalidArgument naming `field` when `data` is not whole values."""
    if len(data) % width:
        raise InvalidArgument(field, f"must hold {width} bytes per value, got {len(data)} bytes")
    values = array.array(_TYPECODES[width])
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    unpacked: list[int] = values.tolist()
    return unpacked


def all_ones(counts: Sequence[int]) -> bool:
    """Whether `counts` is a list of int ones (a decode step's counts, which a packed append leaves implied),
    in two C loops; False for any other entry (`1.0`, an array), which the caller then checks one by one."""
    try:
        return isinstance(counts, list) and counts.count(1) == len(counts) and type(sum(counts)) is int
    except (TypeError, ValueError):  # an entry that does not compare with 1 plainly (a numpy array)
        return False
