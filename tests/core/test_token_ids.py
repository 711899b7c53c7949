"""Token ids as int32 bytes: every accepted form packs to the same bytes; every bad form is refused by field."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv.errors import InvalidArgument
from radixkv.tree.radix_tree import MAX_TOKEN_ID, TokenKey, from_token_bytes, to_token_bytes


@pytest.mark.parametrize(
    "token_ids",
    [[1, 2, 70_000], np.array([1, 2, 70_000], dtype=np.int32), np.array([1, 2, 70_000], dtype=np.int64),
     np.array([1, 2, 70_000], dtype="<i4").tobytes()],
    ids=["list", "int32 array", "int64 array", "packed bytes"],
)  # fmt: skip
def test_every_form_packs_to_little_endian_int32(token_ids: object) -> None:
    data = to_token_bytes(token_ids)  # type: ignore[arg-type]
    assert data == b"\x01\x00\x00\x00\x02\x00\x00\x00\x70\x11\x01\x00"
    assert from_token_bytes(data) == [1, 2, 70_000]


@pytest.mark.parametrize(
    "token_ids",
    [[], [-1], [MAX_TOKEN_ID + 1], [[1, 2]], [1.5], ["a"], b"\x01\x00\x00", np.array([-3], dtype=np.int32),
     np.array([5, -(2**31), 6], dtype="<i4").tobytes(), np.array([7, 8, -1], dtype=np.int32), b""],
    ids=["empty", "negative", "past int32", "nested", "float", "text", "ragged bytes", "negative int32 array",
         "negative in packed bytes", "negative last in an int32 array", "empty bytes"],
)  # fmt: skip
def test_bad_token_ids_name_the_field(token_ids: object) -> None:
    with pytest.raises(InvalidArgument) as refused:
        to_token_bytes(token_ids, "prompts[2].token_ids")  # type: ignore[arg-type]
    assert refused.value.metadata["field"] == "prompts[2].token_ids"


def test_empty_is_allowed_only_when_asked() -> None:
    assert to_token_bytes([], allow_empty=True) == b""
    assert to_token_bytes(b"", allow_empty=True) == b""


def test_the_sign_check_reads_only_each_ids_top_byte() -> None:
    """Packed ids are refused by their sign byte alone: a low byte of 0x80 or more is a valid id."""
    ids = [0x80, 0x8000, 0x800000, MAX_TOKEN_ID, 0]
    assert from_token_bytes(to_token_bytes(np.array(ids, dtype="<i4").tobytes())) == ids
    assert from_token_bytes(to_token_bytes(np.array(ids, dtype=np.int32))) == ids


def test_token_key_owns_the_count_to_offset_arithmetic() -> None:
    key = TokenKey.of(list(range(10)))
    assert key.num_tokens == 10 and key.whole_blocks(4) == 2
    assert from_token_bytes(key.head(3)) == [0, 1, 2]
    assert from_token_bytes(key.tail_after(8)) == [8, 9]
    assert from_token_bytes(key.whole_block_prefix(4)) == list(range(8))
    assert TokenKey.num_bytes(3) == 12 and TokenKey.count(key.data) == 10
