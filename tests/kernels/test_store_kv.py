"""store_kv: the Triton kernel against the torch reference, padding slots, and argument checks."""

from __future__ import annotations

import re

import pytest
import torch

from radixkv.kernels import store_kv, store_kv_reference

gpu = pytest.mark.gpu


def case_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def make_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu)], ids=case_id)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 80), (8, 128), (2, 256)])
def test_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim)
    num_blocks, num_tokens = 12, 9
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = slots.to(device)
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, (k_cache, v_cache), slots, backend="triton")
    store_kv_reference(key, value, (k_ref, v_ref), slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots >= 0
    kept = slots[written]
    assert torch.equal(k_cache[kept // block_size, kept % block_size], key[written])
    assert torch.equal(v_cache[kept // block_size, kept % block_size], value[written])
    # Padding tokens wrote nothing: the cache holds exactly the written tokens' values, zeros elsewhere.
    assert int((k_cache.flatten(0, 1).abs().sum(dim=(1, 2)) > 0).sum()) == int(written.sum())


def test_strided_key_and_value(device):
    # key and value sliced out of a fused KV projection: strided views.
    kv = torch.randn(5, 2, 4, 64, device=device)  # [num_tokens, K or V, num_kv_heads, head_dim]
    key, value = kv[:, 0], kv[:, 1]
    assert not key.is_contiguous()
    k_cache, v_cache = make_caches(4, 2, 4, 64, torch.float32, device)
    slots = torch.tensor([7, 0, 3, -1, 4], device=device)
    store_kv(key, value, (k_cache, v_cache), slots, backend="triton")
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[2, 0], value[4])


def test_no_tokens_is_a_no_op(device):
    k_cache, v_cache = make_caches(2, 4, 1, 64, torch.float32, device)
    empty = torch.empty(0, 1, 64, device=device)
    store_kv(empty, empty, (k_cache, v_cache), torch.empty(0, dtype=torch.int64, device=device), backend="triton")
    assert not k_cache.any()


@pytest.fixture
def args() -> dict:
    k_cache, v_cache = make_caches(4, 4, 2, 64, torch.float32, "cpu")
    return dict(key=torch.randn(3, 2, 64), value=torch.randn(3, 2, 64), kv_layer=(k_cache, v_cache), slots=torch.tensor([0, 5, 15]))


BAD = [
    ("slot beyond the pool", lambda a: a | {"slots": torch.tensor([0, 5, 16])}, "slots"),
    ("slots int32", lambda a: a | {"slots": a["slots"].int()}, "slots"),
    ("slots length", lambda a: a | {"slots": a["slots"][:2]}, "slots"),
    ("value shape", lambda a: a | {"value": a["value"][:2]}, "value"),
    ("value dtype", lambda a: a | {"value": a["value"].half()}, "value"),
    ("key 2-D", lambda a: a | {"key": a["key"][0]}, "key"),
    ("key heads differ", lambda a: a | {"key": torch.randn(3, 1, 64), "value": torch.randn(3, 1, 64)}, "key"),
    ("cache dtype", lambda a: a | {"kv_layer": tuple(c.half() for c in a["kv_layer"])}, "kv_layer[0]"),
    ("v cache shape", lambda a: a | {"kv_layer": (a["kv_layer"][0], a["kv_layer"][1][:2])}, "kv_layer[1]"),
    ("kv_layer not a pair", lambda a: a | {"kv_layer": a["kv_layer"][0]}, "kv_layer"),
    ("block_size not a power of two", lambda a: a | {"kv_layer": make_caches(4, 3, 2, 64, torch.float32, "cpu")}, "kv_layer[0]"),
    ("slots device", lambda a: a | {"slots": a["slots"].to("meta")}, "slots"),
    ("backend unknown", lambda a: a | {"backend": "gpu"}, "backend"),
]


@pytest.mark.parametrize("change,name", [(c, n) for _, c, n in BAD], ids=[label for label, _, _ in BAD])
def test_bad_argument_names_itself(args, change, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}(?![\w\[])"):
        store_kv(**change(args))
    assert not args["kv_layer"][0].any(), "nothing may be written before the checks pass"
