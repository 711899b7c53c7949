"""Token ids as int32 bytes: every accepted form packs to the same bytes; every bad form is refused by field."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv.errors import InvalidArgument
from radixkv.token_ids import MAX_TOKEN_ID, TokenKey, from_token_bytes, to_token_bytes


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
    [[], [-1], [MAX_TOKEN_ID + 1], [[1, 2]], [1.5], ["a"], b"\x01\x00\x00", np.array([-3], dtype=np.int32)],
    ids=["empty", "negative", "past int32", "nested", "float", "text", "ragged bytes", "negative int32 array"],
)
def test_bad_token_ids_name_the_field(token_ids: object) -> None:
    with pytest.raises(InvalidArgument) as refused:
        to_token_bytes(token_ids, "prompts[2].token_ids")  # type: ignore[arg-type]
    assert refused.value.metadata["field"] == "prompts[2].token_ids"


def test_empty_is_allowed_only_when_asked() -> None:
    assert to_token_bytes([], allow_empty=True) == b""


def test_token_key_owns_the_count_to_offset_arithmetic() -> None:
    key = TokenKey.of(list(range(10)))
    assert key.num_tokens == 10 and key.whole_blocks(4) == 2
    assert from_token_bytes(key.head(3)) == [0, 1, 2]
    assert from_token_bytes(key.tail_after(8)) == [8, 9]
    assert from_token_bytes(key.whole_block_prefix(4)) == list(range(8))
    assert TokenKey.num_bytes(3) == 12 and TokenKey.count(key.data) == 10
