"""paged_decode_attention's argument checks, and int64 addressing of big pools (shared by all three kernels)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from radixkv.kernels import paged_decode_attention, paged_decode_attention_reference


@pytest.fixture
def args(paged_batch) -> dict:
    """A valid CPU call: 2 sequences (5 and 20 tokens), 4 query heads over 2 KV heads, blocks of 4, 10 blocks."""
    batch = paged_batch([5, 20], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float32, device="cpu")
    return dict(
        q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, block_tables=batch.block_tables,
        seq_lens=batch.seq_lens, scale=batch.scale,
    )


def _set(a: dict, name: str, index: tuple, value: int) -> dict:
    tensor = a[name].clone()
    tensor[index] = value
    return a | {name: tensor}


def _caches(a: dict, block_size: int, head_dim: int) -> dict:
    shape = (a["k_cache"].shape[0], block_size, a["k_cache"].shape[2], head_dim)
    return a | {"k_cache": torch.randn(shape), "v_cache": torch.randn(shape)}


def _strided_k_cache(a: dict) -> dict:
    num_blocks, block_size, num_kv_heads, head_dim = a["k_cache"].shape
    return a | {"k_cache": torch.randn(num_blocks, block_size, head_dim, num_kv_heads).transpose(2, 3)}


BAD = [
    ("q is not a tensor", lambda a: a | {"q": a["q"].tolist()}, "q"),
    ("q is 2-D", lambda a: a | {"q": a["q"][0]}, "q"),
    ("q is int", lambda a: a | {"q": a["q"].int()}, "q"),
    ("k_cache dtype differs", lambda a: a | {"k_cache": a["k_cache"].half()}, "k_cache"),
    ("v_cache shape differs", lambda a: a | {"v_cache": a["v_cache"][:-1]}, "v_cache"),
    ("head_dim differs", lambda a: a | {"q": a["q"][..., :32]}, "k_cache"),
    ("heads not a multiple", lambda a: a | {"q": torch.randn(2, 3, 64)}, "q"),
    ("block_size not a power of two", lambda a: _caches(a, 3, 64), "k_cache"),
    ("head_dim over 256", lambda a: _caches(a, 4, 320) | {"q": torch.randn(2, 4, 320)}, "q"),
    ("k_cache head_dim strided", _strided_k_cache, "k_cache"),
    ("block_tables int64", lambda a: a | {"block_tables": a["block_tables"].long()}, "block_tables"),
    ("block_tables 1-D", lambda a: a | {"block_tables": a["block_tables"][0]}, "block_tables"),
    ("block_tables rows", lambda a: a | {"block_tables": a["block_tables"][:1]}, "block_tables"),
    ("block_tables device", lambda a: a | {"block_tables": a["block_tables"].to("meta")}, "block_tables"),
    ("seq_lens int64", lambda a: a | {"seq_lens": a["seq_lens"].long()}, "seq_lens"),
    ("seq_lens length", lambda a: a | {"seq_lens": a["seq_lens"][:1]}, "seq_lens"),
    ("seq_lens negative", lambda a: _set(a, "seq_lens", (0,), -1), "seq_lens"),
    ("seq_len beyond its table", lambda a: _set(a, "seq_lens", (1,), 21), "seq_lens"),
    ("block id past the pool", lambda a: _set(a, "block_tables", (1, 2), a["k_cache"].shape[0]), "block_tables"),
    ("negative block id", lambda a: _set(a, "block_tables", (0, 1), -1), "block_tables"),
    ("scale zero", lambda a: a | {"scale": 0.0}, "scale"),
    ("scale NaN", lambda a: a | {"scale": float("nan")}, "scale"),
    ("sliding_window zero", lambda a: a | {"sliding_window": 0}, "sliding_window"),
    ("sliding_window float", lambda a: a | {"sliding_window": 2.5}, "sliding_window"),
    ("soft_cap negative", lambda a: a | {"soft_cap": -1.0}, "soft_cap"),
    ("num_splits zero", lambda a: a | {"num_splits": 0}, "num_splits"),
    ("num_splits over 64", lambda a: a | {"num_splits": 65}, "num_splits"),
    ("backend unknown", lambda a: a | {"backend": "cuda"}, "backend"),
]


@pytest.mark.parametrize("change,name", [(c, n) for _, c, n in BAD], ids=[label for label, _, _ in BAD])
def test_bad_argument_names_itself(args, change, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}\b"):
        paged_decode_attention(**change(args))


def test_valid_call_passes_checks(args):
    # The fixture's tables hold out-of-range ids past each sequence's last block: never read, never rejected.
    assert int(args["block_tables"][0, -1]) >= args["k_cache"].shape[0]
    out = paged_decode_attention(**args, backend="torch")
    assert torch.isfinite(out).all()


def test_blocks_before_the_window_are_not_checked(device, args):
    # Sequence 1 (20 tokens) with a window of 8 reads only blocks 3 and 4 of its table.
    args = _set({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}, "block_tables", (1, 0), -5)
    out = paged_decode_attention(**args, sliding_window=8, backend="triton")
    torch.testing.assert_close(out, paged_decode_attention_reference(**args, sliding_window=8), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="^block_tables"):
        paged_decode_attention(**args, sliding_window=17)


def test_validate_false_gives_the_same_answer(device, args):
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    checked = paged_decode_attention(**args, backend="triton")
    unchecked = paged_decode_attention(**args, backend="triton", validate=False)
    assert torch.equal(checked, unchecked)


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
store_kv(key, value, (k_cache, v_cache), slots, backend="triton")
assert torch.equal(k_cache[high].flatten(0, 1), key) and torch.equal(v_cache[high].flatten(0, 1), value), "store_kv"
q = torch.randn(1, 4, 256, device=device).half()
tables, lens = high[None].int(), torch.tensor([60], dtype=torch.int32, device=device)
out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.0625, num_splits=2, backend="triton")
ref = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.0625)
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
