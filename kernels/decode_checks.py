"""paged_decode_attention's argument checks: shapes, dtypes and Python values always; the data itself only on request.

The first set reads nothing from the device, so it runs on every call; the data checks read the lengths
and block tables back to the host (a device sync on CUDA) and run where that costs nothing (CPU) or when
the caller asks (`validate=True`).
"""

from __future__ import annotations

import math

import torch

from radixkv.kernels.decode_plan import MAX_SPLITS, DecodePlan
from radixkv.kernels.validate import FLOAT_DTYPES, check_kv_layer, check_kv_scales, check_shape, check_tensor, is_int

MAX_HEAD_DIM = 256


def check_decode_args(
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
    if not is_positive_number(scale):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    if sliding_window is not None and (not is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window: expected None or a positive int, got {sliding_window!r}")
    if soft_cap is not None and not is_positive_number(soft_cap):
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


def is_positive_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_decode_contents(
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
