"""The Triton kernels of paged decode attention (flash-decoding); `paged_decode_attention.py` launches them.

`decode_split_kernel`: one program per (sequence, KV head, split) loads each K/V tile once for all the
query heads that share the KV head (GQA/MQA), packed as the rows of a `tl.dot`, and runs an online
softmax over its split's tokens; with one split it writes the output, else fp32 partials (max, sum,
output). `decode_merge_kernel`: one program per (sequence, query head) combines the live partials.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp2 is the native instruction


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
def decode_split_kernel(
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
        v = tl.load(v_ptrs, mask=tok_mask[:, None] & dim_mask[None, :], other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        if USE_KV_SCALES:
            # fp8 V: the select after the cast keeps the compiler from moving the dot's layout change in front of
            # the cast, so V reaches shared memory as copied (16-byte cp.async), is read back and cast in
            # vectors, and meets the dot as 16-bit values (ldmatrix.trans). Without it the dot read 8-bit V
            # from shared memory one byte at a time: 8-bit types have no transposing ldmatrix before sm_100.
            v = tl.where(tok_mask[:, None], v.to(q.dtype), 0.0)
        else:
            v = v.to(q.dtype)
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
def decode_merge_kernel(
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
