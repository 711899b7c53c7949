"""copy_blocks: the Triton kernel against the torch reference over whole pools, and argument checks."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import copy_blocks, copy_blocks_reference

gpu = pytest.mark.gpu


def case_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu), torch.float8_e4m3fn], ids=case_id
)
@pytest.mark.parametrize(
    "num_layers,block_size,num_kv_heads,head_dim",
    [(1, 1, 1, 64), (3, 4, 2, 80), (2, 16, 8, 128)],  # the last block is 16k elements: two programs per copy
)
def test_matches_reference(device, dtype, num_layers, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_layers)
    num_blocks = 10
    kv_data = (
        torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    )
    kv_data.view(torch.uint8)[..., 0, 0, 0] = 0x7F if dtype.itemsize == 1 else 0  # fp8 NaN codes: copied as bits
    before = kv_data.clone()
    pairs = torch.tensor([[1, 7], [3, 2], [9, 0], [1, 5]], device=device)  # one source copied twice
    copy_blocks(kv_data, pairs, backend="triton")
    expected = before.clone()
    copy_blocks_reference(expected, pairs)
    bits, before = kv_data.view(torch.uint8), before.view(torch.uint8)  # bitwise: NaN != NaN as values
    assert torch.equal(bits, expected.view(torch.uint8))
    for src, dst in pairs.tolist():
        assert torch.equal(bits[:, :, dst], before[:, :, src]), "every layer's K and V"
    untouched = [b for b in range(num_blocks) if b not in pairs[:, 1].tolist()]
    assert torch.equal(bits[:, :, untouched], before[:, :, untouched])


def test_no_pairs_is_a_no_op(device):
    kv_data = torch.randn(1, 2, 3, 4, 1, 64, device=device)
    before = kv_data.clone()
    copy_blocks(kv_data, torch.empty(0, 2, dtype=torch.int64, device=device), backend="triton")
    assert torch.equal(kv_data, before)


@pytest.fixture
def args() -> dict:
    return dict(kv_data=torch.randn(2, 2, 6, 4, 2, 64), pairs=torch.tensor([[0, 3], [1, 4]]))


BAD = [
    ("dst past the pool", lambda a: a | {"pairs": torch.tensor([[0, 6]])}, "pairs"),
    ("negative src", lambda a: a | {"pairs": torch.tensor([[-1, 2]])}, "pairs"),
    ("pairs int32", lambda a: a | {"pairs": a["pairs"].int()}, "pairs"),
    ("pairs of three", lambda a: a | {"pairs": torch.tensor([[0, 1, 2]])}, "pairs"),
    ("duplicate dst", lambda a: a | {"pairs": torch.tensor([[0, 3], [1, 3]])}, "pairs"),
    ("dst also a src", lambda a: a | {"pairs": torch.tensor([[0, 3], [3, 4]])}, "pairs"),
    ("kv_data 5-D", lambda a: a | {"kv_data": a["kv_data"][0]}, "kv_data"),
    ("kv_data axis 1 not 2", lambda a: a | {"kv_data": a["kv_data"][:, :1]}, "kv_data"),
    ("kv_data int", lambda a: a | {"kv_data": a["kv_data"].int()}, "kv_data"),
    ("blocks not contiguous", lambda a: a | {"kv_data": a["kv_data"].transpose(3, 4)}, "kv_data"),
    ("pairs device", lambda a: a | {"pairs": a["pairs"].to("meta")}, "pairs"),
    ("backend unknown", lambda a: a | {"backend": "gpu"}, "backend"),
]


@pytest.mark.parametrize("change,name", [(c, n) for _, c, n in BAD], ids=[label for label, _, _ in BAD])
def test_bad_argument_names_itself(args, change, name):
    before = args["kv_data"].clone()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        copy_blocks(**change(args))
    assert torch.equal(args["kv_data"], before), "nothing may be copied before the checks pass"
