"""Integer columns packed as little-endian bytes (the Session stream's packed append fields)."""

import numpy as np
import pytest

from radixkv.errors import InvalidArgument
from radixkv.sequences.packed import all_ones, pack, unpack


def test_columns_round_trip_little_endian() -> None:
    values = [0, 1, 255, 2**31, 2**32 - 1]
    assert pack(values, 4) == np.asarray(values, dtype="<u4").tobytes()
    assert unpack(pack(values, 4), 4, "f") == values
    big = [0, 2**40, 2**64 - 1]
    assert pack(big, 8) == np.asarray(big, dtype="<u8").tobytes() and unpack(pack(big, 8), 8, "f") == big
    assert unpack(b"", 8, "f") == [] and pack(np.arange(3), 4) == pack([0, 1, 2], 4)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"]])
def test_a_value_that_is_not_an_unsigned_int_of_the_width_is_refused(bad: list[object]) -> None:
    with pytest.raises((TypeError, OverflowError)):
        pack(bad, 4)  # type: ignore[arg-type]


def test_bytes_that_are_not_whole_values_name_their_field() -> None:
    with pytest.raises(InvalidArgument) as refused:
        unpack(b"\0" * 12, 8, "packed_seq_ids")
    assert refused.value.field == "packed_seq_ids"


def test_all_ones_is_a_list_of_int_ones() -> None:
    assert all_ones([1, 1, 1]) and all_ones([])
    assert not all_ones([1, 2]) and not all_ones([1.0, 1.0]) and not all_ones(np.ones(3, dtype=np.int64))  # type: ignore[arg-type]
    assert not all_ones([np.ones(2, dtype=np.int64)])  # type: ignore[list-item]  # no truth value: not ones
    assert not all_ones([1, None])  # type: ignore[list-item]
