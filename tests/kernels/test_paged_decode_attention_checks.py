"""paged_decode_attention's argument checks, and int64 addressing of big pools (shared by all three kernels)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from radixkv.kernels import paged_decode_attention, paged_decode_attention_reference, plan_decode


@pytest.fixture
def args(paged_batch) -> dict:
    """A valid CPU call: 2 sequences (5 and 20 tokens), 4 query heads over 2 KV heads, blocks of 4, 10 blocks."""
    batch = paged_batch(
        [5, 20], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float32, device="cpu"
    )
    fields = ("q", "kv_layer", "block_tables", "seq_lens", "scale")
    return {name: getattr(batch, name) for name in fields}


def _set(a: dict, name: str, index: tuple, value: int) -> dict:
    tensor = a[name].clone()
    tensor[index] = value
    return a | {name: tensor}


def _caches(a: dict, block_size: int, head_dim: int) -> dict:
    return a | {"kv_layer": torch.randn(2, a["kv_layer"].shape[1], block_size, a["kv_layer"].shape[3], head_dim)}


def _strided_kv_layer(a: dict) -> dict:
    _, num_blocks, block_size, num_kv_heads, head_dim = a["kv_layer"].shape
    return a | {"kv_layer": torch.randn(2, num_blocks, block_size, head_dim, num_kv_heads).transpose(3, 4)}


def _fp8(a: dict, **extra) -> dict:
    return a | {"kv_layer": a["kv_layer"].to(torch.float8_e4m3fn)} | extra


def _plan(a: dict, num_seqs: int) -> dict:
    lens = [5] * num_seqs
    plan = plan_decode(lens, num_q_heads=4, num_kv_heads=2, head_dim=64, cache_dtype=torch.float32, device="cpu")
    return a | {"plan": plan}


BAD = [
    ("q is not a tensor", lambda a: a | {"q": a["q"].tolist()}, "q"),
    ("q is 2-D", lambda a: a | {"q": a["q"][0]}, "q"),
    ("q is int", lambda a: a | {"q": a["q"].int()}, "q"),
    ("kv_layer dtype differs", lambda a: a | {"kv_layer": a["kv_layer"].half()}, "kv_layer"),
    ("kv_layer a (k, v) pair", lambda a: a | {"kv_layer": tuple(a["kv_layer"])}, "kv_layer"),
    ("kv_layer 4-D", lambda a: a | {"kv_layer": a["kv_layer"][0]}, "kv_layer"),
    ("kv_layer axis 0 not 2", lambda a: a | {"kv_layer": a["kv_layer"][:1]}, "kv_layer"),
    ("kv_layer fp8 e5m2", lambda a: a | {"kv_layer": a["kv_layer"].to(torch.float8_e5m2)}, "kv_layer"),
    ("head_dim differs", lambda a: a | {"q": a["q"][..., :32]}, "kv_layer"),
    ("heads not a multiple", lambda a: a | {"q": torch.randn(2, 3, 64)}, "q"),
    ("block_size not a power of two", lambda a: _caches(a, 3, 64), "kv_layer"),
    ("head_dim over 256", lambda a: _caches(a, 4, 320) | {"q": torch.randn(2, 4, 320)}, "q"),
    ("kv_layer head_dim strided", _strided_kv_layer, "kv_layer"),
    ("fp8 without kv_scales", _fp8, "kv_scales"),
    ("kv_scales fp16", lambda a: _fp8(a, kv_scales=torch.ones(2).half()), "kv_scales"),
    ("kv_scales shape", lambda a: _fp8(a, kv_scales=torch.ones(3)), "kv_scales"),
    ("kv_scales device", lambda a: _fp8(a, kv_scales=torch.ones(2, device="meta")), "kv_scales"),
    ("kv_scales on fp32 caches", lambda a: a | {"kv_scales": torch.ones(2)}, "kv_scales"),
    ("block_tables int64", lambda a: a | {"block_tables": a["block_tables"].long()}, "block_tables"),
    ("block_tables 1-D", lambda a: a | {"block_tables": a["block_tables"][0]}, "block_tables"),
    ("block_tables rows", lambda a: a | {"block_tables": a["block_tables"][:1]}, "block_tables"),
    ("block_tables device", lambda a: a | {"block_tables": a["block_tables"].to("meta")}, "block_tables"),
    ("seq_lens int64", lambda a: a | {"seq_lens": a["seq_lens"].long()}, "seq_lens"),
    ("seq_lens length", lambda a: a | {"seq_lens": a["seq_lens"][:1]}, "seq_lens"),
    ("seq_lens negative", lambda a: _set(a, "seq_lens", (0,), -1), "seq_lens"),
    ("seq_len beyond its table", lambda a: _set(a, "seq_lens", (1,), 21), "seq_lens"),
    ("block id past the pool", lambda a: _set(a, "block_tables", (1, 2), a["kv_layer"].shape[1]), "block_tables"),
    ("negative block id", lambda a: _set(a, "block_tables", (0, 1), -1), "block_tables"),
    ("scale zero", lambda a: a | {"scale": 0.0}, "scale"),
    ("scale NaN", lambda a: a | {"scale": float("nan")}, "scale"),
    ("sliding_window zero", lambda a: a | {"sliding_window": 0}, "sliding_window"),
    ("sliding_window float", lambda a: a | {"sliding_window": 2.5}, "sliding_window"),
    ("soft_cap negative", lambda a: a | {"soft_cap": -1.0}, "soft_cap"),
    ("num_splits zero", lambda a: a | {"num_splits": 0}, "num_splits"),
    ("num_splits over 64", lambda a: a | {"num_splits": 65}, "num_splits"),
    ("backend unknown", lambda a: a | {"backend": "cuda"}, "backend"),
    ("plan for another batch", lambda a: _plan(a, 3), "plan"),
    ("plan not a DecodePlan", lambda a: a | {"plan": {"num_splits": 2}}, "plan"),
    ("plan and num_splits", lambda a: _plan(a, 2) | {"num_splits": 2}, "num_splits"),
]


@pytest.mark.parametrize("change,name", [(c, n) for _, c, n in BAD], ids=[label for label, _, _ in BAD])
def test_bad_argument_names_itself(args, change, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}\b"):
        paged_decode_attention(**change(args))


@pytest.mark.parametrize("num_splits", [0, 65])
def test_plan_rejects_a_split_count_the_merge_cannot_hold(num_splits):
    with pytest.raises(ValueError, match="^num_splits"):
        plan_decode(
            [4096],
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            cache_dtype=torch.float16,
            device="cpu",
            num_splits=num_splits,
        )


def test_valid_call_passes_checks(args):
    # The fixture's tables hold out-of-range ids past each sequence's last block: never read, never rejected.
    assert int(args["block_tables"][0, -1]) >= args["kv_layer"].shape[1]
    out = paged_decode_attention(**args, backend="torch")
    assert torch.isfinite(out).all()


def test_blocks_before_the_window_are_not_checked(device, args):
    # Sequence 1 (20 tokens) with a window of 8 reads only blocks 3 and 4 of its table.
    args = _set(
        {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}, "block_tables", (1, 0), -5
    )
    out = paged_decode_attention(**args, sliding_window=8, backend="triton")
    torch.testing.assert_close(out, paged_decode_attention_reference(**args, sliding_window=8), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="^block_tables"):
        paged_decode_attention(**args, sliding_window=17)


def test_validate_false_gives_the_same_answer(device, args):
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    checked = paged_decode_attention(**args, backend="triton", validate=True)
    unchecked = paged_decode_attention(**args, backend="triton", validate=False)
    torch.testing.assert_close(checked, unchecked, atol=2e-5, rtol=1e-4)  # planned from read vs assumed lengths


def test_validation_is_the_cpu_default_and_a_debug_option(args):
    """Unchecked, a bad block id is the caller's bug (on CUDA the default, to spare the sync); asked, it is an error."""
    bad = _set(args, "block_tables", (1, 2), 10**6)
    with pytest.raises(ValueError, match="^block_tables"):
        paged_decode_attention(**bad, backend="torch")  # CPU tensors: checked by default, no sync to spare
    with pytest.raises(ValueError, match="^block_tables"):
        paged_decode_attention(**bad, backend="torch", validate=True)
    with pytest.raises(IndexError):
        paged_decode_attention(**bad, backend="torch", validate=False)  # torch's own indexing error, unchecked


# Runs in a child process: without the int64 casts the interpreter wraps the offsets and reads or
# writes far outside the pool, which can kill the process rather than fail an assertion.
INT64_SCRIPT = """
import sys, torch
from radixkv.kernels import copy_blocks, paged_decode_attention, paged_decode_attention_reference, store_kv
device = sys.argv[1]
num_blocks = 600_000  # a block is 16 x 1 x 256 = 4096 elements: block ids >= 524_288 pass 2**31 elements
kv = torch.empty(1, 2, num_blocks, 16, 1, 256, dtype=torch.float16, device=device)  # untouched pages cost nothing
k_cache, v_cache = kv[0, 0], kv[0, 1]
high = torch.tensor([num_blocks - 1, 530_000, 599_000, 524_289], device=device)
key = torch.randn(64, 1, 256, device=device).half()
value = torch.randn_like(key)
slots = (high[:, None] * 16 + torch.arange(16, device=device)).flatten()
store_kv(key, value, kv[0], slots, backend="triton")
assert torch.equal(k_cache[high].flatten(0, 1), key) and torch.equal(v_cache[high].flatten(0, 1), value), "store_kv"
q = torch.randn(1, 4, 256, device=device).half()
tables, lens = high[None].int(), torch.tensor([60], dtype=torch.int32, device=device)
out = paged_decode_attention(q, kv[0], tables, lens, 0.0625, num_splits=2, backend="triton")
ref = paged_decode_attention_reference(q, kv[0], tables, lens, 0.0625)
torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
copy_blocks(kv, torch.tensor([[num_blocks - 1, 524_290], [530_000, 599_998]], device=device), backend="triton")
bits = kv.view(torch.int16)
assert torch.equal(bits[:, :, 524_290], bits[:, :, num_blocks - 1]), "copy_blocks"
assert torch.equal(bits[:, :, 599_998], bits[:, :, 530_000]), "copy_blocks"
print("ok")
"""


def test_offsets_past_int32_elements(device):
    """All three kernels address a 600k-block pool at block ids whose element offsets pass 2**31."""
    result = subprocess.run(
        [sys.executable, "-c", INT64_SCRIPT, device], env=dict(os.environ), capture_output=True, text=True, timeout=300
    )
    if any(sign in result.stderr for sign in ("can't allocate memory", "DefaultCPUAllocator", "CUDA out of memory")):
        pytest.skip("this machine cannot reserve the pool's 10 GB")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
