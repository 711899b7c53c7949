"""paged_decode_attention: one query token per sequence against its K/V in a paged cache (flash-decoding).

One program of the split kernel handles one (sequence, KV head, split): it loads each K/V tile once for
all the query heads that share the KV head (GQA/MQA), packed as the rows of a `tl.dot`. Splits have
one length for the whole batch (`DecodePlan.split_len`), sized from the batch's lengths so that the
longest sequence alone is cut into enough programs to fill the device; a short sequence's splits past
its end do nothing. Partial (max, sum, output) go to fp32 scratch and the merge kernel combines them;
with one split the split kernel writes the output directly.

fp8 e4m3 caches are read with their scales folded in: `k_scale` into the score scale, `v_scale` into
the output. The hot path (`validate=False`, the default on CUDA, with a `DecodePlan` made from host-side
lengths) reads nothing back from the device.

In this file: the two kernels, tile configs, the plan, the argument checks, the launcher, the torch reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from radixkv.kernels.backend import pick_backend
from radixkv.kernels.validate import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    check_kv_layer,
    check_kv_scales,
    check_shape,
    check_tensor,
    is_int,
    should_validate,
)

LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp2 is the native instruction
MAX_HEAD_DIM = 256
MAX_SPLITS = 64  # the merge kernel holds [splits, head_dim] partials of one head in registers
# Tokens per split below which splitting costs more (scratch, a second launch, a pipeline prologue) than it recovers.
MIN_TOKENS_PER_SPLIT = 256
# Programs per SM the split sizing aims for: two keep an SM busy while one waits on memory.
PROGRAMS_PER_SM = 2


# ---------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tanh(x):
    # tanh through exp2, which every backend and the interpreter have; saturates to +-1 for large |x|, never NaN.
    e = tl.exp2(x * (2 * LOG2E))  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _context(seq_lens_ptr, seq, stride_sl, sliding_window, USE_WINDOW: tl.constexpr):
    """The attended tokens [ctx_start, seq_len) of sequence `seq`."""
    seq_len = tl.load(seq_lens_ptr + seq * stride_sl)
    ctx_start = 0
    if USE_WINDOW:
        ctx_start = tl.maximum(seq_len - sliding_window, 0)
    return ctx_start, seq_len


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_ml_ptr,
    part_acc_ptr,
    scale,
    soft_cap,
    sliding_window,
    split_len,
    stride_q_s,
    stride_q_h,
    stride_q_d,
    stride_kv,
    stride_kv_b,
    stride_kv_t,
    stride_kv_h,
    stride_bt_s,
    stride_bt_b,
    stride_sl,
    stride_out_s,
    stride_out_h,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_KV_SCALES: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # This split's tokens [start, end); the last split runs to the end, so any plan covers every token.
    ctx_start, seq_len = _context(seq_lens_ptr, seq, stride_sl, sliding_window, USE_WINDOW)
    start = ctx_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if split == num_splits - 1:
        end = seq_len

    rows = tl.arange(0, GROUP_PAD)  # [GROUP_PAD] query heads of this KV head, padded for tl.dot
    row_mask = rows < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + rows  # [GROUP_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]
    k_scale = 1.0
    v_scale = 1.0
    if USE_KV_SCALES:  # fp8: stored = value / scale
        k_scale = tl.load(kv_scales_ptr)
        v_scale = tl.load(kv_scales_ptr + 1)
    qk_scale = scale * k_scale * LOG2E
    if USE_SOFT_CAP:
        qk_scale = scale * k_scale  # the cap bends natural-log logits; LOG2E comes after it

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # running sum of p @ v
    tokens = tl.arange(0, TILE_N)  # [TILE_N]
    k_head_ptr = kv_ptr + kv_head * stride_kv_h
    v_head_ptr = kv_ptr + stride_kv + kv_head * stride_kv_h
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tokens  # [TILE_N]
        tok_mask = pos < end
        # int64 before multiplying: block_id * stride overflows int32 in pools of ~1M blocks.
        table_ptrs = block_tables_ptr + seq * stride_bt_s + (pos // BLOCK_SIZE) * stride_bt_b  # [TILE_N]
        block_ids = tl.load(table_ptrs, mask=tok_mask, other=0)
        block_ids = block_ids.to(tl.int64)  # [TILE_N]
        offsets = pos % BLOCK_SIZE  # [TILE_N]
        k_ptrs = k_head_ptr + (block_ids * stride_kv_b + offsets * stride_kv_t)[None, :] + dims[:, None]
        k = tl.load(k_ptrs, mask=dim_mask[:, None] & tok_mask[None, :], other=0.0).to(q.dtype)  # [HEAD_DIM_PAD, TILE_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, TILE_N]
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap) * LOG2E
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [GROUP_PAD]; finite: every tile holds a valid token
        alpha = tl.exp2(m_i - m_new)  # [GROUP_PAD]
        p = tl.exp2(s - m_new[:, None])  # [GROUP_PAD, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_head_ptr + (block_ids * stride_kv_b + offsets * stride_kv_t)[:, None] + dims[None, :]
        v = tl.load(v_ptrs, mask=tok_mask[:, None] & dim_mask[None, :], other=0.0).to(q.dtype)  # [TILE_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc * v_scale

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # part_ml: [2, num_seqs, num_q_heads, num_splits]; part_acc: [num_seqs, num_q_heads, num_splits, head_dim].
        # An empty split (past its sequence's end) writes nothing: the merge reads only the live ones.
        live_rows = rows < tl.where(start < end, GROUP_SIZE, 0)  # [GROUP_PAD]
        num_q_heads = tl.num_programs(1) * GROUP_SIZE
        part = (seq * num_q_heads + heads) * num_splits + split  # [GROUP_PAD]
        num_parts = tl.num_programs(0) * num_q_heads * num_splits
        tl.store(part_ml_ptr + part, m_i, mask=live_rows)
        tl.store(part_ml_ptr + num_parts + part, l_i, mask=live_rows)
        acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]
        tl.store(acc_ptrs, acc, mask=live_rows[:, None] & dim_mask[None, :])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence has l_i == 0 and writes zeros
        out_ptrs = out_ptr + seq * stride_out_s + heads[:, None] * stride_out_h + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_merge_kernel(
    part_ml_ptr,
    part_acc_ptr,
    seq_lens_ptr,
    out_ptr,
    sliding_window,
    split_len,
    num_splits,
    stride_sl,
    stride_out_s,
    stride_out_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_q_heads = tl.num_programs(1)
    num_parts = tl.num_programs(0) * num_q_heads * num_splits
    ctx_start, seq_len = _context(seq_lens_ptr, seq, stride_sl, sliding_window, USE_WINDOW)
    num_live = tl.minimum(tl.cdiv(tl.maximum(seq_len - ctx_start, 0), split_len), num_splits)  # as the split kernel cut
    splits = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    split_mask = splits < num_live
    part = (seq * num_q_heads + head) * num_splits + splits  # [SPLITS_PAD]
    m_i = tl.load(part_ml_ptr + part, mask=split_mask, other=float("-inf"))  # [SPLITS_PAD] base-2 maxima
    l_i = tl.load(part_ml_ptr + num_parts + part, mask=split_mask, other=0.0)  # [SPLITS_PAD]
    m_max = tl.max(m_i, axis=0)
    # No live split: an empty sequence, whose output is zeros.
    w = tl.exp2(m_i - tl.where(m_max == float("-inf"), 0.0, m_max))  # [SPLITS_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM
    acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]
    acc = tl.load(acc_ptrs, mask=split_mask[:, None] & dim_mask[None, :], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    total = tl.sum(w * l_i, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_PAD]
    tl.store(out_ptr + seq * stride_out_s + head * stride_out_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


# ---------------------------------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeConfig:
    """How one split-kernel program walks its tokens: `tile_n` tokens per K/V tile, `num_stages` software-pipeline
    stages (the loop's loads run that many tiles ahead), `num_warps` per program."""

    tile_n: int
    num_warps: int
    num_stages: int


# By (head_dim padded to 64/128/256, cache element bytes). Each K or V tile is 16 KiB (8 for fp8 at head_dim
# 64), so one stage of both is 32 KiB: even at 5 stages the buffers (at most 4 x 32 KiB) fit an H100/H200
# SM's 228 KiB. Stages: the block-id load and the K load that depends on it each take one, so 3 stages
# leave K and V a single buffer each (the next tile's loads never overlap this tile's math, as the sm_90a
# review found) and 5 double-buffer them. Reasoned defaults, not yet measured on a GPU:
# `bench_paged_decode_attention.py --configs` (run by benchmarks/gpu_check.sh) times each neighbour.
DECODE_CONFIGS: dict[tuple[int, int], DecodeConfig] = {
    (64, 4): DecodeConfig(tile_n=64, num_warps=4, num_stages=4),
    (64, 2): DecodeConfig(tile_n=128, num_warps=4, num_stages=5),
    (64, 1): DecodeConfig(tile_n=128, num_warps=4, num_stages=5),
    (128, 4): DecodeConfig(tile_n=32, num_warps=4, num_stages=4),
    (128, 2): DecodeConfig(tile_n=64, num_warps=4, num_stages=5),
    (128, 1): DecodeConfig(tile_n=128, num_warps=4, num_stages=5),
    (256, 4): DecodeConfig(tile_n=16, num_warps=4, num_stages=4),
    (256, 2): DecodeConfig(tile_n=32, num_warps=8, num_stages=5),
    (256, 1): DecodeConfig(tile_n=64, num_warps=8, num_stages=5),
}


def decode_config(head_dim: int, cache_dtype: torch.dtype) -> DecodeConfig:
    """The table's config for this head_dim and cache dtype."""
    return DECODE_CONFIGS[(max(64, triton.next_power_of_2(head_dim)), cache_dtype.itemsize)]


# ---------------------------------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One decode step's launch decisions and scratch, made on the host once and shared by every layer's call.

    `num_splits * split_len` need not cover the longest sequence (the last split runs to the end), so a
    plan made from stale or assumed lengths costs speed, never correctness. Every call reuses the scratch:
    calls sharing a plan run in order on one stream, as a model's layers do.
    """

    num_seqs: int
    num_q_heads: int
    head_dim: int
    split_len: int  # tokens per split, a multiple of config.tile_n
    num_splits: int  # grid axis 2: the longest sequence's splits
    config: DecodeConfig
    part_ml: torch.Tensor | None  # fp32 [2, num_seqs, num_q_heads, num_splits]; None with one split
    part_acc: torch.Tensor | None  # fp32 [num_seqs, num_q_heads, num_splits, head_dim]; None with one split


def plan_decode(
    seq_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    device: str | torch.device,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    num_sms: int | None = None,
    config: DecodeConfig | None = None,
) -> DecodePlan:
    """The plan for a batch whose lengths the caller knows on the host (the scheduler does): no device read.

    Args:
        seq_lens: each sequence's length, as `seq_lens` will hold it on the device.
        num_splits: force this many splits of the longest sequence (tests, benchmarks); None sizes them.
        num_sms: the device's SM count (default: read once from the device; tests pass a small one).
        config: tile/warps/stages (default: `DECODE_CONFIGS` for head_dim and cache_dtype).

    Raises:
        ValueError: num_splits outside [1, MAX_SPLITS].
    """
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    device = torch.device(device)
    config = config or decode_config(head_dim, cache_dtype)
    lens = [min(n, sliding_window) if sliding_window else n for n in seq_lens]
    longest = max(lens, default=0)
    if num_splits is None:
        split_len = choose_split_len(lens, num_kv_heads, num_sms or _num_sms(device), config.tile_n)
    else:
        split_len = _round_up(max(1, math.ceil(longest / num_splits)), config.tile_n)
    num_splits = max(1, math.ceil(longest / split_len))
    split = num_splits > 1 and len(lens) > 0
    num_seqs = len(lens)
    part_ml = part_acc = None
    if split:
        part_ml = torch.empty((2, num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=device)
        part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    return DecodePlan(num_seqs, num_q_heads, head_dim, split_len, num_splits, config, part_ml, part_acc)


def choose_split_len(seq_lens: Sequence[int], num_kv_heads: int, num_sms: int, tile_n: int) -> int:
    """Tokens per split: the batch's (token, KV head) work cut into about PROGRAMS_PER_SM x num_sms equal runs.

    Sized from the total, not the batch size, so the longest sequence of a ragged batch (one 128k among
    short ones) alone gets enough programs to fill the device, while a batch of many long sequences that
    fills it already runs one split each. At least MIN_TOKENS_PER_SPLIT, and at most MAX_SPLITS splits.
    """
    longest = max(seq_lens, default=0)
    if longest < 2 * MIN_TOKENS_PER_SPLIT:
        return _round_up(max(1, longest), tile_n)  # too short to cut in two worthwhile splits
    work = sum(seq_lens) * num_kv_heads
    even_share = math.ceil(work / (PROGRAMS_PER_SM * num_sms))
    split_len = max(even_share, MIN_TOKENS_PER_SPLIT, math.ceil(longest / MAX_SPLITS))
    return _round_up(split_len, tile_n)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1  # the interpreter runs programs on the CPU, one after another


# ---------------------------------------------------------------------------------------------------- checks


def _check_args(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None,
    sliding_window: int | None,
    soft_cap: float | None,
    num_splits: int | None,
    plan: DecodePlan | None,
) -> None:
    """Raise ValueError naming the first bad argument; reads only shapes, dtypes and Python values (no device sync)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    num_seqs, num_q_heads, head_dim = q.shape
    check_kv_layer(kv_layer, q.dtype, device)
    _, _, _, num_kv_heads, cache_head_dim = kv_layer.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_layer: head_dim {cache_head_dim} differs from q's {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_q_heads {num_q_heads} is not a multiple of kv_layer's num_kv_heads {num_kv_heads}")
    check_kv_scales(kv_scales, kv_layer)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables: expected {num_seqs} rows (q's num_seqs), got shape {tuple(block_tables.shape)}"
        )
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    if not _is_positive_number(scale):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    if sliding_window is not None and (not is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window: expected None or a positive int, got {sliding_window!r}")
    if soft_cap is not None and not _is_positive_number(soft_cap):
        raise ValueError(f"soft_cap: expected None or a positive finite number, got {soft_cap!r}")
    if num_splits is not None and (not is_int(num_splits) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if plan is not None:
        if num_splits is not None:
            raise ValueError("num_splits: give num_splits or plan, not both")
        if not isinstance(plan, DecodePlan):
            raise ValueError(f"plan: expected a DecodePlan from plan_decode, got {type(plan).__name__}")
        if (plan.num_seqs, plan.num_q_heads, plan.head_dim) != (num_seqs, num_q_heads, head_dim):
            raise ValueError(
                f"plan: made for (num_seqs, num_q_heads, head_dim) = "
                f"{(plan.num_seqs, plan.num_q_heads, plan.head_dim)}, q is {tuple(q.shape)}"
            )
        if plan.part_ml is not None and plan.part_ml.device != device:
            raise ValueError(f"plan: its scratch is on {plan.part_ml.device}, q on {device}")


def _is_positive_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_contents(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int, sliding_window: int | None
) -> list[int]:
    """The data checks (a device sync on CUDA): lengths fit their tables, every block read is in the pool.

    Returns the lengths, read to the host.
    """
    lens = seq_lens.long()  # [num_seqs]
    host_lens = lens.tolist()
    if not host_lens:
        return host_lens
    shortest, longest = min(host_lens), max(host_lens)
    if shortest < 0:
        raise ValueError(f"seq_lens: lengths must be >= 0, got {shortest}")
    capacity = block_tables.shape[1] * block_size
    if longest > capacity:
        seq = host_lens.index(longest)
        raise ValueError(
            f"seq_lens: seq_lens[{seq}] = {longest} exceeds its block table's capacity "
            f"({block_tables.shape[1]} blocks x {block_size} = {capacity} tokens)"
        )
    first = (lens - sliding_window).clamp(min=0) // block_size if sliding_window else torch.zeros_like(lens)
    last = (lens + block_size - 1) // block_size  # [num_seqs] one past the last block read
    cols = torch.arange(block_tables.shape[1], device=lens.device)  # [max_blocks_per_seq]
    read = (cols[None, :] >= first[:, None]) & (cols[None, :] < last[:, None])  # [num_seqs, max_blocks_per_seq]
    bad = read & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        seq, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables: block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is out of range "
            f"for a pool of {num_blocks} blocks"
        )
    return host_lens


# ---------------------------------------------------------------------------------------------------- launcher


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    plan: DecodePlan | None = None,
    backend: str | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its first `seq_lens[i]` cached tokens.

    Args:
        q: `[num_seqs, num_q_heads, head_dim]`, fp32/fp16/bf16; head_dim <= 256.
        kv_layer: one layer's K and V `[2, num_blocks, block_size, num_kv_heads, head_dim]`
            (a worker's `PoolView.layer(l)`),
            in q's dtype or fp8 e4m3; num_q_heads must be a multiple of num_kv_heads (MHA, GQA, MQA).
        block_tables: int32 `[num_seqs, max_blocks_per_seq]`; row i lists sequence i's blocks in order.
        seq_lens: int32 `[num_seqs]`; 0 gives a zero output row.
        scale: the softmax scale, usually `head_dim ** -0.5`.
        kv_scales: fp32 `[2]` (k_scale, v_scale) on the cache's device, with an fp8 kv_layer only.
        sliding_window: attend only to the last `sliding_window` tokens.
        soft_cap: logits become `soft_cap * tanh(logits / soft_cap)` before the softmax (Gemma-2).
        num_splits: force this many splits of the longest sequence (tests, benchmarks).
        plan: `plan_decode(...)` for this batch, made once per step from host-side lengths: its split
            length and scratch serve every layer. Without one, the launcher plans from the lengths it
            validated, or else assumes every sequence fills its block table.
        backend: "triton" or "torch" to force one; None picks (see `radixkv.kernels.backend`).
        validate: read `seq_lens` and `block_tables` to reject bad lengths and block ids. A device sync on
            CUDA (and impossible under CUDA-graph capture), so None, the default, checks on CPU tensors
            only; True is the debug option on CUDA.

    Returns:
        `[num_seqs, num_q_heads, head_dim]` in q's dtype.

    Raises:
        ValueError: a malformed argument (the message starts with its name); when validating, also a
            block id out of range or a sequence longer than its block table.
    """
    _check_args(q, kv_layer, block_tables, seq_lens, scale, kv_scales, sliding_window, soft_cap, num_splits, plan)
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
    host_lens = None
    if should_validate(validate, q.device):
        host_lens = _check_contents(block_tables, seq_lens, num_blocks, block_size, sliding_window)
    if pick_backend(q.device, backend) == "torch":
        return paged_decode_attention_reference(
            q,
            kv_layer,
            block_tables,
            seq_lens,
            scale,
            kv_scales=kv_scales,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [num_seqs, num_q_heads, head_dim]
    if num_seqs == 0:
        return out
    if plan is None:
        assumed = host_lens if host_lens is not None else [block_tables.shape[1] * block_size] * num_seqs
        plan = plan_decode(
            assumed,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            cache_dtype=kv_layer.dtype,
            device=q.device,
            sliding_window=sliding_window,
            num_splits=num_splits,
        )
    split = plan.part_ml is not None
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    group_size = num_q_heads // num_kv_heads
    _decode_split_kernel[(num_seqs, num_kv_heads, plan.num_splits)](
        q,
        kv_layer,
        kv_scales if kv_scales is not None else seq_lens,
        block_tables,
        seq_lens,
        out,
        plan.part_ml if split else out,
        plan.part_acc if split else out,
        float(scale),
        float(soft_cap or 1.0),
        int(sliding_window or 0),
        plan.split_len,
        *q.stride(),
        *kv_layer.stride()[:4],
        *block_tables.stride(),
        seq_lens.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=group_size,
        GROUP_PAD=max(16, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=plan.config.tile_n,
        USE_SOFT_CAP=soft_cap is not None,
        USE_WINDOW=sliding_window is not None,
        USE_KV_SCALES=kv_layer.dtype == FP8_DTYPE,
        SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 gets fp32 products, not tf32
        num_warps=plan.config.num_warps,
        num_stages=plan.config.num_stages,
    )
    if split:
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            plan.part_ml,
            plan.part_acc,
            seq_lens,
            out,
            int(sliding_window or 0),
            plan.split_len,
            plan.num_splits,
            seq_lens.stride(0),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
            USE_WINDOW=sliding_window is not None,
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------------- reference


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """The torch version (no argument checks): gather each sequence's K/V by its block table, dequantize, fp32 math.

    What the Triton kernel is tested against and what CPU serving runs, so it stays plain: one sequence
    at a time, no splits, no online softmax. Shapes and meaning as `paged_decode_attention`.
    """
    num_seqs, num_q_heads, head_dim = q.shape  # q: [num_seqs, num_q_heads, head_dim]
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]  # kv_layer: [2, num_blocks, block_size, H, D]
    group_size = num_q_heads // num_kv_heads
    k_scale, v_scale = kv_scales.float() if kv_scales is not None else (1.0, 1.0)
    out = torch.zeros_like(q)  # [num_seqs, num_q_heads, head_dim]
    for i, seq_len in enumerate(seq_lens.tolist()):
        start = max(0, seq_len - sliding_window) if sliding_window is not None else 0
        if seq_len <= start:
            continue
        first = start // block_size  # whole blocks gathered, then cut to [start, seq_len)
        block_ids = block_tables[i, first : -(-seq_len // block_size)].long()  # [num_read_blocks]
        cut = slice(start - first * block_size, seq_len - first * block_size)
        k = kv_layer[0, block_ids].flatten(0, 1)[cut].float() * k_scale  # [n, num_kv_heads, head_dim]
        v = kv_layer[1, block_ids].flatten(0, 1)[cut].float() * v_scale  # [n, num_kv_heads, head_dim]
        qi = q[i].float().reshape(num_kv_heads, group_size, head_dim)  # [num_kv_heads, group_size, head_dim]
        scores = (qi @ k.permute(1, 2, 0)) * scale  # [num_kv_heads, group_size, n]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.softmax(dim=-1)  # [num_kv_heads, group_size, n]
        out[i] = (probs @ v.transpose(0, 1)).reshape(num_q_heads, head_dim).to(q.dtype)
    return out
