"""paged_decode_attention: the Triton kernel against the torch reference, and both against dense SDPA; ragged
batches and the split plan; fp8 caches; the hot path that never reads the device."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import (
    DecodeConfig,
    choose_split_len,
    copy_blocks,
    paged_decode_attention,
    paged_decode_attention_reference,
    plan_decode,
    store_kv,
)
from radixkv.kernels.backend import INTERPRETED, pick_backend

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

# The module itself: `radixkv.kernels.paged_decode_attention` as an attribute is the function the package exports.
decode_module = importlib.import_module("radixkv.kernels.paged_decode_attention")
F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn
gpu = pytest.mark.gpu


def run(batch, **kwargs) -> torch.Tensor:
    """The Triton kernel on `batch` (its fp8 scales included)."""
    return paged_decode_attention(*batch.args(), kv_scales=batch.kv_scales, backend="triton", **kwargs)


def reference(batch, **kwargs) -> torch.Tensor:
    return paged_decode_attention_reference(*batch.args(), kv_scales=batch.kv_scales, **kwargs)


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


def sdpa_decode(q, kv_layer, block_tables, seq_lens, scale, sliding_window=None) -> torch.Tensor:
    """An independent formulation: whole blocks gathered into a dense [n, H, D] run, then torch SDPA."""
    k_cache, v_cache = kv_layer  # [num_blocks, block_size, num_kv_heads, head_dim] each
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
        boundary_lens(block_size),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        table=table,
    )
    out = run(batch, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert_close(out, reference(batch), dtype, tolerances)


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
        [300, 1, 0, 2 * block_size],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        table="sliced",
        seed=1,
    )
    expected = sdpa_decode(*batch.args(), sliding_window=sliding_window)
    out = run(batch, sliding_window=sliding_window, num_splits=num_splits)
    assert_close(out, expected, dtype, tolerances)
    assert_close(reference(batch, sliding_window=sliding_window), expected, dtype, tolerances)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [1, 13, 64, 1000])
def test_sliding_window(device, paged_batch, tolerances, sliding_window, num_splits):
    lens = [200, 64, 13, 0]
    batch = paged_batch(lens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32, device=device)
    out = run(batch, sliding_window=sliding_window, num_splits=num_splits)
    expected = reference(batch, sliding_window=sliding_window)
    assert_close(out, expected, F32, tolerances)
    full = reference(batch)
    window_bites = sliding_window < max(lens)
    assert window_bites == (not torch.allclose(expected, full, atol=1e-3)), (
        "the window must change the result iff it cuts"
    )


@pytest.mark.parametrize("dtype", [F32, F16, pytest.param(BF16, marks=gpu)], ids=case_id)
@pytest.mark.parametrize("soft_cap", [2.0, 30.0])
def test_soft_cap(device, paged_batch, tolerances, dtype, soft_cap):
    batch = paged_batch(
        [150, 1, 33], num_q_heads=6, num_kv_heads=2, head_dim=80, block_size=16, dtype=dtype, device=device
    )
    batch.q *= 4  # large logits, so the cap bends them
    out = run(batch, soft_cap=soft_cap, num_splits=2)
    expected = reference(batch, soft_cap=soft_cap)
    assert_close(out, expected, dtype, tolerances)
    uncapped = reference(batch)
    assert not torch.allclose(expected.float(), uncapped.float(), atol=1e-2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_zero_length_sequences(device, paged_batch, tolerances, num_splits):
    batch = paged_batch(
        [0, 40, 0, 1], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=4, dtype=F16, device=device
    )
    out = run(batch, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(out, reference(batch), F16, tolerances)
    # A batch of only empty sequences: every split is empty, the merge must still give zeros, not NaN.
    empty = paged_batch([0, 0], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4, dtype=F32, device=device)
    out = run(empty, num_splits=num_splits)
    assert torch.equal(out, torch.zeros_like(out))


def test_empty_batch(device, paged_batch):
    batch = paged_batch([], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=F32, device=device)
    assert run(batch).shape == (0, 4, 64)


def test_strided_q(device, paged_batch, tolerances):
    batch = paged_batch([70, 5], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=F16, device=device)
    qkv = torch.randn(2, 12, 64, dtype=F16, device=device)  # [num_seqs, q + k + v heads, head_dim]
    qkv[:, :8] = batch.q
    batch.q = qkv[:, :8]  # a strided view, as sliced out of a fused QKV projection
    assert not batch.q.is_contiguous()
    out = run(batch)
    assert_close(out, reference(batch), F16, tolerances)


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
    # A plain bound: the kernels' tests import nothing of radixkv outside the kernels (test_import_closure.py).
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


GPU_GROUPS = [(4, 4), (10, 2), (6, 1), (7, 1), (32, 8), (16, 1), (64, 8)]  # (num_q_heads, num_kv_heads)
BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
HEAD_DIMS = [64, 80, 96, 128, 256]
# Four cases per (q dtype, cache dtype), rotating through the block sizes and head dims so that together
# they take each block size 2-3 times and each head dim 4 times: 20 cases, about 40 compilations, which
# keeps `pytest -m gpu tests/kernels` short (gpu_check.sh runs it in what is left of its 5 minutes; the full
# grid would be 200 cases). The interpreted tests already cover every block size and head dim in fp32 and fp16.
GPU_SWEEP = [
    (dtype, kv_dtype, BLOCK_SIZES[(4 * k + i) % len(BLOCK_SIZES)], HEAD_DIMS[(k + i) % len(HEAD_DIMS)])
    for k, (dtype, kv_dtype) in enumerate([(F32, F32), (F16, F16), (BF16, BF16), (F16, FP8), (BF16, FP8)])
    for i in range(4)
]


@gpu
@pytest.mark.parametrize("dtype,kv_dtype,block_size,head_dim", GPU_SWEEP, ids=case_id)
def test_gpu_sweep(device, paged_batch, tolerances, dtype, kv_dtype, block_size, head_dim):
    """Dtypes x block sizes x head dims on a ragged batch, the device's own plan, the default (unchecked) path."""
    num_q_heads, num_kv_heads = GPU_GROUPS[(block_size.bit_length() + head_dim) % len(GPU_GROUPS)]
    batch = paged_batch(
        [1, 3 * block_size, 3 * block_size + 1, 1000, 20000],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        table="sliced",
        kv_dtype=kv_dtype,
    )
    out = paged_decode_attention(*batch.args(), kv_scales=batch.kv_scales)
    assert_close(out, reference(batch), dtype, tolerances)


# ---------------------------------------------------------------------------------------- ragged batches, the plan

RAGGED = [1500, 3, 0, 40, 700, 1, 16]  # one long sequence among short and empty ones


def test_choose_split_len_sizes_from_the_longest_not_the_batch():
    """The H200 shapes of issue 18 (132 SMs, 8 KV heads, 64-token tiles)."""
    ragged = [131072] + [1024] * 31
    split_len = choose_split_len(ragged, num_kv_heads=8, num_sms=132, tile_n=64)
    long_programs = -(-131072 // split_len) * 8
    assert long_programs >= 132, "the 128k sequence alone must cover every SM"
    assert split_len >= 1024, "a 1k sequence stays one split"
    assert choose_split_len([4096] * 64, num_kv_heads=8, num_sms=132, tile_n=64) >= 4096, "64 x 4k fills the device"
    one_32k = choose_split_len([32768], num_kv_heads=8, num_sms=132, tile_n=64)
    assert -(-32768 // one_32k) * 8 >= 132 and one_32k % 64 == 0
    assert choose_split_len([300], num_kv_heads=8, num_sms=132, tile_n=64) == 320, "one split under 2 x 256 tokens"
    assert choose_split_len([600], num_kv_heads=8, num_sms=132, tile_n=64) == 256, "at least 256 tokens per split"
    assert choose_split_len([10**6], num_kv_heads=8, num_sms=132, tile_n=64) >= 10**6 / 64, "at most 64 splits"


def test_forced_splits_are_an_upper_bound_in_whole_tiles():
    """`num_splits` asks for at most that many: a split is whole tiles, so 2,560 tokens in 64-token tiles asked for
    64 splits run 40 (one tile each) and asked for 30 run 20 (two tiles each); the plan says what runs."""
    kwargs = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, cache_dtype=F16, device="meta")
    tile = plan_decode([2560], **kwargs).config.tile_n
    assert tile == 64
    assert (
        plan_decode([2560], num_splits=64, **kwargs).num_splits,
        plan_decode([2560], num_splits=30, **kwargs).split_len,
    ) == (40, 128)
    for longest in (1, 63, 64, 65, 2560, 4097):
        for asked in range(1, 65):
            plan = plan_decode([longest, 5], num_splits=asked, **kwargs)
            fewest_tiles = math.ceil(math.ceil(longest / asked) / tile) * tile  # whole tiles holding that many tokens
            assert plan.split_len == fewest_tiles and plan.num_splits == max(1, -(-longest // plan.split_len))
            assert plan.num_splits <= asked and (plan.num_splits - 1) * plan.split_len < longest


@pytest.mark.parametrize(
    "dtype,kv_dtype,sliding_window", [(F32, F32, None), (F16, F16, 600), (F16, FP8, None)], ids=case_id
)
def test_ragged_batch(device, paged_batch, tolerances, dtype, kv_dtype, sliding_window):
    batch = paged_batch(
        RAGGED,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=device,
        kv_dtype=kv_dtype,
    )
    plan = plan_decode(
        RAGGED,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        cache_dtype=batch.kv_layer.dtype,
        device=device,
        sliding_window=sliding_window,
        num_sms=8,
    )
    longest = min(max(RAGGED), sliding_window or max(RAGGED))
    assert plan.num_splits == -(-longest // plan.split_len) >= 2, "the long sequence is cut, the short ones are not"
    out = run(batch, plan=plan, sliding_window=sliding_window, validate=False)
    expected = reference(batch, sliding_window=sliding_window)
    assert_close(out, expected, dtype, tolerances)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(run(batch, num_splits=1, sliding_window=sliding_window), expected, dtype, tolerances)


def test_plan_serves_every_layer_without_reading_the_device(device, paged_batch, tolerances, monkeypatch):
    """The hot path's logic: validate=False with a plan made from host lengths reads no tensor contents (on
    CUDA that would be a sync), plans nothing per call, and the merge reads only the splits that ran."""
    layers = [  # one step's batch of sequences (layer 0's tables), each layer with its own q and cache
        paged_batch(RAGGED, num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=8, dtype=F16, device=device, seed=s)
        for s in range(2)
    ]
    tables, lens = layers[0].block_tables, layers[0].seq_lens
    plan = plan_decode(RAGGED, num_q_heads=4, num_kv_heads=1, head_dim=64, cache_dtype=F16, device=device, num_sms=1)
    assert plan.num_splits == 2 and plan.part_ml is not None and plan.part_acc is not None
    plan.part_ml.fill_(float("nan"))  # a partial the merge must not read stays NaN and would poison the output
    plan.part_acc.fill_(float("nan"))
    expected = [paged_decode_attention_reference(b.q, b.kv_layer, tables, lens, b.scale) for b in layers]

    def forbidden(*args, **kwargs):
        raise AssertionError("the hot path read the device or planned again")

    monkeypatch.setattr(decode_module, "check_decode_contents", forbidden)
    monkeypatch.setattr(decode_module, "plan_decode", forbidden)
    for batch, want in zip(layers, expected, strict=True):
        out = paged_decode_attention(
            batch.q, batch.kv_layer, tables, lens, batch.scale, plan=plan, validate=False, backend="triton"
        )
        assert_close(out, want, F16, tolerances)
    assert not torch.isnan(plan.part_acc[0]).any(), "the 1500-token sequence ran in both splits"
    assert torch.isnan(plan.part_acc[1, :, 1]).all(), "a 3-token sequence ran one split; its second wrote nothing"


def test_a_stale_plan_costs_speed_not_tokens(device, paged_batch, tolerances):
    """A plan made from shorter lengths than the device holds: the last split runs to each sequence's end."""
    batch = paged_batch(RAGGED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=F32, device=device)
    stale = plan_decode(
        [n // 3 for n in RAGGED], num_q_heads=4, num_kv_heads=2, head_dim=64, cache_dtype=F32, device=device, num_sms=1
    )
    assert stale.num_splits * stale.split_len < max(RAGGED)
    assert_close(run(batch, plan=stale, validate=False), reference(batch), F32, tolerances)


def test_unvalidated_call_without_a_plan_assumes_full_tables(device, paged_batch, tolerances, monkeypatch):
    batch = paged_batch(RAGGED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=F16, device=device)
    planned = []
    real_plan = decode_module.plan_decode

    def recording_plan(lens, **kwargs):
        planned.append(list(lens))
        return real_plan(lens, **kwargs)

    monkeypatch.setattr(decode_module, "plan_decode", recording_plan)
    assert_close(run(batch, validate=False), reference(batch), F16, tolerances)
    capacity = batch.block_tables.shape[1] * 16
    assert planned == [[capacity] * len(RAGGED)], "without read lengths, every table is taken as full"
    run(batch, validate=True)
    assert planned[-1] == RAGGED, "validated lengths are planned from as they are"


@pytest.mark.parametrize("config", [DecodeConfig(16, 4, 2), DecodeConfig(128, 8, 2)], ids=lambda c: f"tile{c.tile_n}")
def test_explicit_config(device, paged_batch, tolerances, config):
    """What the benchmark's --configs sweep runs: other tiles give the same answer (fp16: a 128-token tile of
    head_dim 128 is 32 KiB for K, one stage fits any GPU's shared memory)."""
    batch = paged_batch(RAGGED, num_q_heads=6, num_kv_heads=2, head_dim=80, block_size=4, dtype=F16, device=device)
    plan = plan_decode(
        RAGGED, num_q_heads=6, num_kv_heads=2, head_dim=80, cache_dtype=F16, device=device, num_sms=2, config=config
    )
    assert plan.split_len % config.tile_n == 0
    assert_close(run(batch, plan=plan), reference(batch), F16, tolerances)


# ---------------------------------------------------------------------------------------- fp8 caches

FP8_CASES = [  # (q dtype, block_size, head_dim, num_q_heads, num_kv_heads, num_splits)
    (F32, 1, 64, 4, 4, 2),
    (F32, 16, 128, 8, 2, None),
    (F16, 4, 80, 6, 1, 3),
    (F16, 32, 256, 4, 2, None),
    (F16, 128, 96, 16, 2, 2),
    pytest.param(BF16, 16, 128, 32, 8, 4, marks=gpu),
]


@pytest.mark.parametrize("dtype,block_size,head_dim,num_q_heads,num_kv_heads,num_splits", FP8_CASES, ids=case_id)
def test_fp8_matches_reference(
    device, paged_batch, tolerances, dtype, block_size, head_dim, num_q_heads, num_kv_heads, num_splits
):
    """Caches quantized by torch, read by the kernel with the scales folded in, against the reference on the
    same caches dequantized: every fp8 value is exact in fp16/bf16/fp32, so q's dtype's tolerance holds."""
    batch = paged_batch(
        boundary_lens(block_size),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        table="sliced",
        kv_dtype=FP8,
    )
    out = run(batch, num_splits=num_splits)
    assert out.dtype == dtype
    assert_close(out, reference(batch), dtype, tolerances)
    with pytest.raises(ValueError, match="^kv_scales"):
        paged_decode_attention(*batch.args(), backend="triton")


@pytest.mark.parametrize("soft_cap,sliding_window", [(None, None), (5.0, 37)])
def test_fp8_error_is_the_quantization_error(device, paged_batch, soft_cap, sliding_window):
    """Against full-precision caches, fp8 output is off by what quantizing costs and no more.

    Measured on these caches (stored values ~ N(0, 3), max |V| 0.064): the reference on the dequantized
    caches differs from the reference on the originals by 1.25e-3 at most (2% of max |V|: e4m3 keeps 3
    mantissa bits, and the 1-token sequence's output is one V row, unaveraged); the kernel adds 4e-6 (fp16
    q) or 3e-9 (fp32 q) on top. So the bound is the measured error itself, and a tenth of it for the kernel.
    """
    batch = paged_batch(
        [300, 77, 1],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=F32,
        device=device,
        kv_dtype=FP8,
    )
    kw = dict(soft_cap=soft_cap, sliding_window=sliding_window)
    exact = paged_decode_attention_reference(batch.q, batch.original_kv, *batch.args()[2:], **kw)
    dequantized = reference(batch, **kw)
    quantization_error = (dequantized - exact).abs().max().item()
    scale_of_v = batch.original_kv[1].abs().max().item()
    assert 0 < quantization_error < 2**-4 * scale_of_v, "more than e4m3's half-ulp: the caches were mis-quantized"
    out = run(batch, num_splits=3, **kw)
    kernel_error = (out - dequantized).abs().max().item()
    assert kernel_error < quantization_error / 10
    torch.testing.assert_close(out, exact, atol=quantization_error * 1.1, rtol=0)


# ---------------------------------------------------------------------------------------- no sync on CUDA


@gpu
@pytest.mark.parametrize("kv_dtype", [F16, FP8], ids=case_id)
def test_hot_path_never_syncs(device, paged_batch, tolerances, kv_dtype):
    """A decode step as a worker runs it: copy-on-write, store the new tokens, attend, all with the default
    `validate`, under torch's sync debug mode set to raise on any GPU -> CPU synchronisation."""
    lens = [4097, 3, 1000, 17]
    batch = paged_batch(
        lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=F16, device=device, kv_dtype=kv_dtype
    )
    pool = batch.kv_layer[None]  # [1, 2, num_blocks, block_size, num_kv_heads, head_dim]: a one-layer pool
    key = torch.randn(len(lens), 8, 128, dtype=F16, device=device)
    value = torch.randn_like(key)
    last = batch.seq_lens.long() - 1  # [num_seqs] the newest token's position
    slots = batch.block_tables.gather(1, (last // 16)[:, None])[:, 0].long() * 16 + last % 16  # [num_seqs]
    pairs = torch.tensor([[batch.kv_layer.shape[1] - 1, batch.kv_layer.shape[1] - 2]], device=device)  # spare blocks
    plan = plan_decode(
        lens, num_q_heads=32, num_kv_heads=8, head_dim=128, cache_dtype=batch.kv_layer.dtype, device=device
    )

    def step() -> torch.Tensor:
        copy_blocks(pool, pairs)
        store_kv(key, value, batch.kv_layer, slots, kv_scales=batch.kv_scales)
        return paged_decode_attention(*batch.args(), kv_scales=batch.kv_scales, plan=plan)

    step()  # compiles the kernels outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
        unplanned = paged_decode_attention(*batch.args(), kv_scales=batch.kv_scales)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(out, reference(batch), F16, tolerances)
    assert_close(unplanned, out, F16, tolerances)
