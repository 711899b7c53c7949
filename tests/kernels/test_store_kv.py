"""store_kv: the Triton kernel against the torch reference, padding slots, fp8 quantizing stores, argument checks."""

from __future__ import annotations

import re

import pytest
import torch

from radixkv.kernels import quantize_fp8, store_kv, store_kv_reference

gpu = pytest.mark.gpu
FP8, F32 = torch.float8_e4m3fn, torch.float32


def case_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def make_kv_layer(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device) -> torch.Tensor:
    return torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)


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
    kv_layer = make_kv_layer(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    expected = kv_layer.clone()
    store_kv(key, value, kv_layer, slots, backend="triton")
    store_kv_reference(key, value, expected, slots)
    assert torch.equal(kv_layer, expected)
    k_cache, v_cache = kv_layer
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
    kv_layer = make_kv_layer(4, 2, 4, 64, torch.float32, device)
    slots = torch.tensor([7, 0, 3, -1, 4], device=device)
    store_kv(key, value, kv_layer, slots, backend="triton")
    assert torch.equal(kv_layer[0, 3, 1], key[0]) and torch.equal(kv_layer[1, 2, 0], value[4])


def test_no_tokens_is_a_no_op(device):
    kv_layer = make_kv_layer(2, 4, 1, 64, torch.float32, device)
    empty = torch.empty(0, 1, 64, device=device)
    store_kv(empty, empty, kv_layer, torch.empty(0, dtype=torch.int64, device=device), backend="triton")
    assert not kv_layer.any()


def _fp8_store(dtype, device, scales=(0.5, 0.05)):
    """Keys often beyond +-448 x k_scale (saturated), values never past 448 x v_scale; a zeroed fp8 layer."""
    gen = torch.Generator().manual_seed(7)
    key = (torch.randn(40, 2, 64, generator=gen) * 100).to(dtype).to(device)
    value = (torch.randn(40, 2, 64, generator=gen) * 2).to(dtype).to(device)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 224.0, 0.0])  # beyond 448 x 0.5 both ways, exactly 448, zero
    kv_scales = torch.tensor(scales, device=device)
    slots = torch.randperm(16 * 4, generator=gen)[:40].to(device)
    slots[3] = -1
    kv_layer = torch.zeros(2, 16, 4, 2, 64, dtype=FP8, device=device)
    return key, value, kv_layer, slots, kv_scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_store_quantizes_with_saturation(dtype):
    """The torch path (what CPU always runs for fp8): value / scale, saturated to +-448, one rounding."""
    key, value, kv_layer, slots, kv_scales = _fp8_store(dtype, "cpu")
    store_kv(key, value, kv_layer, slots, kv_scales=kv_scales)  # the default backend under the interpreter too
    assert not torch.isnan(kv_layer.float()).any(), "saturated, never NaN"
    written = slots >= 0
    kept = slots[written]
    k_stored = kv_layer[0, kept // 4, kept % 4].float()  # [num_kept, 2, 64]
    v_stored = kv_layer[1, kept // 4, kept % 4].float()
    assert k_stored[0, 0, :4].tolist() == [448.0, -448.0, 448.0, 0.0]
    assert torch.equal(k_stored, quantize_fp8(key[written], 0.5).float())
    # Dequantized, an unsaturated value is within e4m3's half-ulp (2^-4 relative) or its subnormal step (2^-10).
    exact = value[written].float()
    assert ((v_stored * 0.05 - exact).abs() <= exact.abs() * 2**-4 + 0.05 * 2**-10).all()
    with pytest.raises(ValueError, match="^backend"):
        store_kv(key, value, kv_layer, slots, kv_scales=kv_scales, backend="triton")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_fp8_store_matches_torch(device, dtype):
    """The Triton quantizing store (GPU only: the interpreter's fp8 conversion is wrong) against torch's."""
    key, value, kv_layer, slots, kv_scales = _fp8_store(dtype, device)
    expected = kv_layer.clone()
    store_kv(key, value, kv_layer, slots, kv_scales=kv_scales, backend="triton")
    store_kv_reference(key, value, expected, slots, kv_scales=kv_scales)
    assert not torch.isnan(kv_layer.float()).any()
    # Both divide in fp32 and round once to nearest-even; allow a neighbouring code on a rare tie, nothing more.
    codes, want = kv_layer.view(torch.int8).long(), expected.view(torch.int8).long()
    assert (codes == want).float().mean() > 0.999
    assert ((codes - want).abs() <= 1).all()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, FP8], ids=case_id)
def test_nan_stays_nan_and_infinity_saturates(device, cache_dtype):
    """The module's promise: a NaN input stores as NaN (a model bug stays visible); in fp8 an infinite or huge value
    stores as +-448, never NaN. fp8 runs Triton on CUDA and torch on CPU; both must keep it."""
    dtype = F32 if cache_dtype == FP8 else cache_dtype
    key = torch.tensor([[[float("nan"), float("inf"), -float("inf"), 1e6, 0.5, -2.0, 0.0, 3.0]]], device=device)
    key = key.to(dtype)  # [1 token, 1 head, 8]
    value = key.flip(-1).clone()
    kv_layer = make_kv_layer(2, 2, 1, 8, cache_dtype, device)
    scales = torch.tensor([0.5, 2.0], device=device) if cache_dtype == FP8 else None
    store_kv(key, value, kv_layer, torch.tensor([3], device=device), kv_scales=scales)
    k, v = kv_layer[0, 1, 1, 0].float().cpu(), kv_layer[1, 1, 1, 0].float().cpu()  # [8] each, as stored
    assert torch.isnan(k[0]) and torch.isnan(v[7]) and not torch.isnan(k[1:]).any() and not torch.isnan(v[:7]).any()
    if cache_dtype == FP8:
        assert k[1:4].tolist() == [448.0, -448.0, 448.0] and k[4:].tolist() == [1.0, -4.0, 0.0, 6.0]
        assert v[4:7].tolist() == [448.0, -448.0, 448.0] and v[:4].tolist() == [1.5, 0.0, -1.0, 0.25]
    else:
        assert torch.equal(k[1:], key[0, 0, 1:].cpu()) and torch.equal(v[:7], value[0, 0, :7].cpu())


@pytest.fixture
def args() -> dict:
    kv_layer = make_kv_layer(4, 4, 2, 64, torch.float32, "cpu")
    return dict(
        key=torch.randn(3, 2, 64), value=torch.randn(3, 2, 64), kv_layer=kv_layer, slots=torch.tensor([0, 5, 15])
    )


BAD = [
    ("slot beyond the pool", lambda a: a | {"slots": torch.tensor([0, 5, 16])}, "slots"),
    ("slots int32", lambda a: a | {"slots": a["slots"].int()}, "slots"),
    ("slots length", lambda a: a | {"slots": a["slots"][:2]}, "slots"),
    ("value shape", lambda a: a | {"value": a["value"][:2]}, "value"),
    ("value dtype", lambda a: a | {"value": a["value"].half()}, "value"),
    ("key 2-D", lambda a: a | {"key": a["key"][0]}, "key"),
    ("key heads differ", lambda a: a | {"key": torch.randn(3, 1, 64), "value": torch.randn(3, 1, 64)}, "key"),
    ("cache dtype", lambda a: a | {"kv_layer": a["kv_layer"].half()}, "kv_layer"),
    ("kv_layer a (k, v) pair", lambda a: a | {"kv_layer": tuple(a["kv_layer"])}, "kv_layer"),
    ("kv_layer axis 0 not 2", lambda a: a | {"kv_layer": a["kv_layer"][:1]}, "kv_layer"),
    ("block_size not a power of two", lambda a: a | {"kv_layer": make_kv_layer(4, 3, 2, 64, F32, "cpu")}, "kv_layer"),
    ("fp8 without kv_scales", lambda a: a | {"kv_layer": a["kv_layer"].to(FP8)}, "kv_scales"),
    ("kv_scales on fp32 caches", lambda a: a | {"kv_scales": torch.ones(2)}, "kv_scales"),
    ("slots device", lambda a: a | {"slots": a["slots"].to("meta")}, "slots"),
    ("backend unknown", lambda a: a | {"backend": "gpu"}, "backend"),
]


@pytest.mark.parametrize("change,name", [(c, n) for _, c, n in BAD], ids=[label for label, _, _ in BAD])
def test_bad_argument_names_itself(args, change, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}(?![\w\[])"):
        store_kv(**change(args))
    assert not args["kv_layer"].any(), "nothing may be written before the checks pass"
