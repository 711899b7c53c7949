"""paged_decode_attention: one query token per sequence against its K/V in a paged cache (flash-decoding).

One program handles one (sequence, KV head, split): it loads each K/V tile once for all the query
heads that share the KV head (GQA/MQA), packed as the rows of a `tl.dot`. Long contexts are cut into
splits whose partial (max, sum, output) go to fp32 scratch; a second kernel merges them
(`decode_merge.py`). Short contexts run one split that writes the output directly.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from radixkv.kernels.backend import pick_backend
from radixkv.kernels.decode_checks import MAX_SPLITS, check_decode_args
from radixkv.kernels.decode_merge import merge_splits
from radixkv.kernels.decode_reference import paged_decode_attention_reference

# Tokens per split below which splitting costs more (scratch + a second launch) than it recovers.
MIN_TOKENS_PER_SPLIT = 256
# Programs per SM the split heuristic aims for: two keep an SM busy while one waits on memory.
PROGRAMS_PER_SM = 2


@triton.jit
def _tanh(x):
    # tanh through exp2, which every backend and the interpreter have; saturates to +-1 for large |x|, never NaN.
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_ml_ptr, part_acc_ptr,
    scale, soft_cap, sliding_window, num_splits,
    stride_q_s, stride_q_h, stride_q_d,
    stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h,
    stride_bt_s, stride_bt_b, stride_sl,
    stride_out_s, stride_out_h,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    # This split's token range [start, end): the attended context cut into num_splits TILE_N-aligned runs.
    seq_len = tl.load(seq_lens_ptr + seq * stride_sl)
    ctx_start = 0
    if USE_WINDOW:
        ctx_start = tl.maximum(seq_len - sliding_window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - ctx_start, num_splits), TILE_N) * TILE_N
    start = ctx_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)  # [GROUP_PAD] query heads of this KV head, padded for tl.dot
    row_mask = rows < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + rows  # [GROUP_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp2 is the native instruction
    if USE_SOFT_CAP:
        qk_scale = scale

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # running sum of p @ v
    tokens = tl.arange(0, TILE_N)  # [TILE_N]
    k_head_ptr = k_cache_ptr + kv_head * stride_k_h
    v_head_ptr = v_cache_ptr + kv_head * stride_v_h
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tokens  # [TILE_N]
        tok_mask = pos < end
        # int64 before multiplying: block_id * stride overflows int32 in pools of ~1M blocks.
        block_ids = tl.load(block_tables_ptr + seq * stride_bt_s + (pos // BLOCK_SIZE) * stride_bt_b, mask=tok_mask, other=0)
        block_ids = block_ids.to(tl.int64)  # [TILE_N]
        offsets = pos % BLOCK_SIZE  # [TILE_N]
        k_ptrs = k_head_ptr + (block_ids * stride_k_b + offsets * stride_k_t)[None, :] + dims[:, None]
        k = tl.load(k_ptrs, mask=dim_mask[:, None] & tok_mask[None, :], other=0.0)  # [HEAD_DIM_PAD, TILE_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, TILE_N]
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap) * 1.4426950408889634
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [GROUP_PAD]; finite: every tile holds a valid token
        alpha = tl.exp2(m_i - m_new)  # [GROUP_PAD]
        p = tl.exp2(s - m_new[:, None])  # [GROUP_PAD, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_head_ptr + (block_ids * stride_v_b + offsets * stride_v_t)[:, None] + dims[None, :]
        v = tl.load(v_ptrs, mask=tok_mask[:, None] & dim_mask[None, :], other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # part_ml: [2, num_seqs, num_q_heads, num_splits]; part_acc: [num_seqs, num_q_heads, num_splits, head_dim]
        num_q_heads = tl.num_programs(1) * GROUP_SIZE
        part = (seq * num_q_heads + heads) * num_splits + split  # [GROUP_PAD]
        num_parts = tl.num_programs(0) * num_q_heads * num_splits
        tl.store(part_ml_ptr + part, m_i, mask=row_mask)
        tl.store(part_ml_ptr + num_parts + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence has l_i == 0 and writes zeros
        out_ptrs = out_ptr + seq * stride_out_s + heads[:, None] * stride_out_h + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its first `seq_lens[i]` cached tokens.

    Args:
        q: `[num_seqs, num_q_heads, head_dim]`, fp32/fp16/bf16; head_dim <= 256.
        k_cache, v_cache: one layer's caches `[num_blocks, block_size, num_kv_heads, head_dim]`, q's dtype;
            num_q_heads must be a multiple of num_kv_heads (MHA, GQA, MQA).
        block_tables: int32 `[num_seqs, max_blocks_per_seq]`; row i lists sequence i's blocks in order.
        seq_lens: int32 `[num_seqs]`; 0 gives a zero output row.
        scale: the softmax scale, usually `head_dim ** -0.5`.
        sliding_window: attend only to the last `sliding_window` tokens.
        soft_cap: logits become `soft_cap * tanh(logits / soft_cap)` before the softmax (Gemma-2).
        num_splits: split-K count; None picks one from the batch, the context and the device.
        backend: "triton" or "torch" to force one; None picks (see `radixkv.kernels.backend`).
        validate: False skips the checks that read `seq_lens` and `block_tables` (a device sync on CUDA,
            impossible under CUDA-graph capture); the split heuristic then sizes for the table's capacity.

    Returns:
        `[num_seqs, num_q_heads, head_dim]` in q's dtype.

    Raises:
        ValueError: a malformed argument (the message starts with its name), a block id out of range,
            or a sequence longer than its block table.
    """
    max_seq_len = check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, num_splits, validate
    )
    if pick_backend(q.device, backend) == "torch":
        return paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    num_seqs, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [num_seqs, num_q_heads, head_dim]
    if num_seqs == 0:
        return out
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group_size = num_q_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if sliding_window is not None:
        max_seq_len = min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(q.device))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    # Scratch for the partials; dummies when one split writes the output directly.
    part_ml = q.new_empty((2, num_seqs, num_q_heads, num_splits) if split else (1,), dtype=torch.float32)
    part_acc = q.new_empty((num_seqs, num_q_heads, num_splits, head_dim) if split else (1,), dtype=torch.float32)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_ml, part_acc,
        float(scale), float(soft_cap or 1.0), int(sliding_window or 0), num_splits,
        *q.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *block_tables.stride(), seq_lens.stride(0),
        out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, GROUP_PAD=max(16, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=64 if head_dim_pad <= 128 else 32,
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 caches get fp32 products, not tf32
        num_warps=4,
    )
    if split:
        merge_splits(part_ml, part_acc, out)
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K count: enough (sequence, KV head, split) programs to fill the SMs, >= 256 tokens per split.

    Large batches already fill the device and get 1 split; so do contexts too short to be worth cutting.
    """
    if max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1  # the interpreter runs programs on the CPU, one after another
