"""The second pass of split-K decode: merge each split's partial (max, sum, output) into the final output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_splits_kernel(
    part_ml_ptr, part_acc_ptr, out_ptr,
    num_splits, stride_out_s, stride_out_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_q_heads = tl.num_programs(1)
    num_parts = tl.num_programs(0) * num_q_heads * num_splits
    splits = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    split_mask = splits < num_splits
    part = (seq * num_q_heads + head) * num_splits + splits  # [SPLITS_PAD]
    m_i = tl.load(part_ml_ptr + part, mask=split_mask, other=float("-inf"))  # [SPLITS_PAD] base-2 maxima
    l_i = tl.load(part_ml_ptr + num_parts + part, mask=split_mask, other=0.0)  # [SPLITS_PAD]
    m_max = tl.max(m_i, axis=0)
    # Empty splits (m_i == -inf) weigh 0; when every split is empty, so is the sequence: output zeros.
    w = tl.exp2(m_i - tl.where(m_max == float("-inf"), 0.0, m_max))  # [SPLITS_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM
    acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]
    acc = tl.load(acc_ptrs, mask=split_mask[:, None] & dim_mask[None, :], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    total = tl.sum(w * l_i, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_PAD]
    tl.store(out_ptr + seq * stride_out_s + head * stride_out_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def merge_splits(part_ml: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor) -> None:
    """Write `out` from the partials of `_paged_decode_kernel`.

    Args:
        part_ml: fp32 `[2, num_seqs, num_q_heads, num_splits]`: each split's base-2 max, then its sum.
        part_acc: fp32 `[num_seqs, num_q_heads, num_splits, head_dim]`: each split's unnormalised output.
        out: `[num_seqs, num_q_heads, head_dim]`, contiguous in head_dim.
    """
    num_seqs, num_q_heads, num_splits, head_dim = part_acc.shape
    _merge_splits_kernel[(num_seqs, num_q_heads)](
        part_ml, part_acc, out,
        num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
