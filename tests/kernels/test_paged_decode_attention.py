"""paged_decode_attention: the Triton kernel against the torch reference, and both against dense SDPA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import choose_num_splits, paged_decode_attention, paged_decode_attention_reference
from radixkv.kernels.backend import INTERPRETED, pick_backend

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


def case_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None

# (dtype, block_size, head_dim, num_q_heads, num_kv_heads, num_splits, table): every block size,
# head dim and GQA group size (1-8, 16, MQA) at least once per interpreted dtype.
CASES = [
    (F32, 1, 64, 4, 4, None, "shuffled"),
    (F32, 2, 80, 10, 2, 2, "sliced"),
    (F32, 4, 96, 6, 1, 3, "shared"),
    (F32, 8, 128, 7, 1, None, "shuffled"),
    (F32, 16, 256, 8, 2, 5, "sliced"),
    (F32, 32, 64, 16, 1, 2, "shuffled"),
    (F32, 64, 80, 3, 3, None, "shared"),
    (F32, 128, 128, 2, 1, 4, "shuffled"),
    (F16, 1, 128, 8, 1, 3, "sliced"),
    (F16, 2, 64, 14, 2, None, "shuffled"),
    (F16, 4, 256, 4, 2, None, "shared"),
    (F16, 8, 80, 6, 6, 2, "shuffled"),
    (F16, 16, 96, 5, 1, None, "sliced"),
    (F16, 32, 128, 12, 2, 7, "shared"),
    (F16, 64, 256, 16, 1, 2, "sliced"),
    (F16, 128, 64, 3, 1, None, "shuffled"),
    pytest.param(BF16, 1, 96, 7, 1, 2, "sliced", marks=gpu),
    pytest.param(BF16, 16, 128, 32, 8, None, "shuffled", marks=gpu),
    pytest.param(BF16, 64, 80, 5, 5, 3, "shared", marks=gpu),
    pytest.param(BF16, 128, 256, 6, 1, None, "shuffled", marks=gpu),
]


def boundary_lens(block_size: int) -> list[int]:
    """One token, a run ending exactly on a block boundary, one past it, and a few tiles' worth."""
    boundary = block_size * max(1, 48 // block_size)
    return [1, boundary, boundary + 1, 257]


def sdpa_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None) -> torch.Tensor:
    """An independent formulation: whole blocks gathered into a dense [n, H, D] run, then torch SDPA."""
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group_size = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [num_seqs, num_q_heads, head_dim]
    for i, n in enumerate(seq_lens.tolist()):
        start = max(0, n - sliding_window) if sliding_window else 0
        if n == start:
            continue
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[start:n].float()  # [m, num_kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[start:n].float()
        k = k.transpose(0, 1).repeat_interleave(group_size, dim=0)[None]  # [1, num_q_heads, m, head_dim]
        v = v.transpose(0, 1).repeat_interleave(group_size, dim=0)[None]
        qi = q[i].float()[None, :, None, :]  # [1, num_q_heads, 1, head_dim]
        out[i] = F.scaled_dot_product_attention(qi, k, v, scale=scale)[0, :, 0]
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tolerances) -> None:
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,block_size,head_dim,num_q_heads,num_kv_heads,num_splits,table", CASES, ids=case_id)
def test_matches_reference(
    device, paged_batch, tolerances, dtype, block_size, head_dim, num_q_heads, num_kv_heads, num_splits, table
):
    batch = paged_batch(
        boundary_lens(block_size), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, table=table,
    )
    out = paged_decode_attention(*batch.args(), num_splits=num_splits, backend="triton")
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert_close(out, paged_decode_attention_reference(*batch.args()), dtype, tolerances)


@pytest.mark.parametrize(
    "dtype,block_size,head_dim,num_q_heads,num_kv_heads,num_splits,sliding_window",
    [
        (F32, 16, 128, 8, 2, 1, None),
        (F32, 4, 64, 7, 1, 3, None),
        (F16, 8, 96, 4, 4, 2, None),
        (F32, 2, 80, 6, 2, 2, 37),
        pytest.param(BF16, 16, 128, 32, 8, 4, None, marks=gpu),
    ],
    ids=case_id,
)
def test_matches_dense_sdpa(
    device, paged_batch, tolerances, dtype, block_size, head_dim, num_q_heads, num_kv_heads, num_splits, sliding_window
):
    batch = paged_batch(
        [300, 1, 0, 2 * block_size], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, table="sliced", seed=1,
    )
    expected = sdpa_decode(*batch.args(), sliding_window=sliding_window)
    out = paged_decode_attention(*batch.args(), sliding_window=sliding_window, num_splits=num_splits, backend="triton")
    assert_close(out, expected, dtype, tolerances)
    reference = paged_decode_attention_reference(*batch.args(), sliding_window=sliding_window)
    assert_close(reference, expected, dtype, tolerances)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [1, 13, 64, 1000])
def test_sliding_window(device, paged_batch, tolerances, sliding_window, num_splits):
    lens = [200, 64, 13, 0]
    batch = paged_batch(lens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32, device=device)
    out = paged_decode_attention(*batch.args(), sliding_window=sliding_window, num_splits=num_splits, backend="triton")
    expected = paged_decode_attention_reference(*batch.args(), sliding_window=sliding_window)
    assert_close(out, expected, F32, tolerances)
    full = paged_decode_attention_reference(*batch.args())
    window_bites = sliding_window < max(lens)
    assert window_bites == (not torch.allclose(expected, full, atol=1e-3)), "the window must change the result iff it cuts"


@pytest.mark.parametrize("dtype", [F32, F16, pytest.param(BF16, marks=gpu)], ids=case_id)
@pytest.mark.parametrize("soft_cap", [2.0, 30.0])
def test_soft_cap(device, paged_batch, tolerances, dtype, soft_cap):
    batch = paged_batch([150, 1, 33], num_q_heads=6, num_kv_heads=2, head_dim=80, block_size=16, dtype=dtype, device=device)
    batch.q *= 4  # large logits, so the cap bends them
    out = paged_decode_attention(*batch.args(), soft_cap=soft_cap, num_splits=2, backend="triton")
    expected = paged_decode_attention_reference(*batch.args(), soft_cap=soft_cap)
    assert_close(out, expected, dtype, tolerances)
    uncapped = paged_decode_attention_reference(*batch.args())
    assert not torch.allclose(expected.float(), uncapped.float(), atol=1e-2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_zero_length_sequences(device, paged_batch, tolerances, num_splits):
    batch = paged_batch([0, 40, 0, 1], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=4, dtype=F16, device=device)
    out = paged_decode_attention(*batch.args(), num_splits=num_splits, backend="triton")
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(out, paged_decode_attention_reference(*batch.args()), F16, tolerances)
    # A batch of only empty sequences: every split is empty, the merge must still give zeros, not NaN.
    empty = paged_batch([0, 0], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4, dtype=F32, device=device)
    out = paged_decode_attention(*empty.args(), num_splits=num_splits, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))


def test_empty_batch(device, paged_batch):
    batch = paged_batch([], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=F32, device=device)
    assert paged_decode_attention(*batch.args(), backend="triton").shape == (0, 4, 64)


def test_long_context_heuristic_splits(device, paged_batch, tolerances):
    lens = [1800]
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=1800, num_sms=1) > 1
    batch = paged_batch(lens, num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=F32, device=device)
    out = paged_decode_attention(*batch.args(), backend="triton")
    assert_close(out, paged_decode_attention_reference(*batch.args()), F32, tolerances)
    one_split = paged_decode_attention(*batch.args(), num_splits=1, backend="triton")
    assert_close(out, one_split, F32, tolerances)


def test_strided_q(device, paged_batch, tolerances):
    batch = paged_batch([70, 5], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=F16, device=device)
    qkv = torch.randn(2, 12, 64, dtype=F16, device=device)  # [num_seqs, q + k + v heads, head_dim]
    qkv[:, :8] = batch.q
    batch.q = qkv[:, :8]  # a strided view, as sliced out of a fused QKV projection
    assert not batch.q.is_contiguous()
    out = paged_decode_attention(*batch.args(), backend="triton")
    assert_close(out, paged_decode_attention_reference(*batch.args()), F16, tolerances)


def test_choose_num_splits():
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1  # short: no split
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1  # SMs already full
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 33  # 264 programs
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=1024, num_sms=132) == 4  # >= 256 tokens each
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=10**6, num_sms=132) == 64  # capped


def test_forced_torch_backend_is_the_reference(device, paged_batch):
    batch = paged_batch([50, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32, device=device)
    out = paged_decode_attention(*batch.args(), backend="torch")
    assert torch.equal(out, paged_decode_attention_reference(*batch.args()))
    assert pick_backend(torch.device(device), None) == "triton"
    with pytest.raises(ValueError, match="^backend"):
        paged_decode_attention(*batch.args(), backend="cuda")


@pytest.mark.skipif(not INTERPRETED, reason="checks the interpreter-less CPU default from an interpreted run")
def test_cpu_defaults_to_torch_without_interpreter():
    code = (
        "import torch\n"
        "from radixkv.kernels.backend import pick_backend\n"
        "assert pick_backend(torch.device('cpu'), None) == 'torch'\n"
        "try:\n"
        "    pick_backend(torch.device('cpu'), 'triton')\n"
        "except ValueError as e:\n"
        "    assert str(e).startswith('backend'), e\n"
        "else:\n"
        "    raise SystemExit('triton on CPU without the interpreter was accepted')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


GPU_GROUPS = [(4, 4), (10, 2), (6, 1), (7, 1), (32, 8), (16, 1), (64, 8)]  # (num_q_heads, num_kv_heads)


@gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=case_id)
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_gpu_sweep(device, paged_batch, tolerances, dtype, block_size, head_dim):
    """The full dtype x block size x head dim grid, with longer contexts and the device's own split heuristic."""
    num_q_heads, num_kv_heads = GPU_GROUPS[(block_size.bit_length() + head_dim) % len(GPU_GROUPS)]
    batch = paged_batch(
        [1, 3 * block_size, 3 * block_size + 1, 1000, 4097], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=device, table="sliced",
    )
    out = paged_decode_attention(*batch.args())
    assert_close(out, paged_decode_attention_reference(*batch.args()), dtype, tolerances)
