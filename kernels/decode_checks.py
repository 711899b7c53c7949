"""Argument checks of paged_decode_attention, run before any launch: a bad block id must never read another
sequence's memory (or outside the pool) and come back as a plausible answer."""

from __future__ import annotations

import math

import torch

from radixkv.kernels.validate import (
    FLOAT_DTYPES,
    check_block_size,
    check_head_dim_contiguous,
    check_shape,
    check_tensor,
)

MAX_HEAD_DIM = 256
MAX_SPLITS = 64  # the merge kernel holds [splits, head_dim] partials of one head in registers


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_splits: int | None,
    validate: bool,
) -> int | None:
    """Raise ValueError naming the first bad argument; return the longest sequence when `validate` read it."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    num_seqs, num_q_heads, head_dim = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape), "(the shape of k_cache)")
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check_block_size("k_cache", block_size)
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {cache_head_dim} differs from q's {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_q_heads {num_q_heads} is not a multiple of k_cache's num_kv_heads {num_kv_heads}")
    check_head_dim_contiguous("k_cache", k_cache)
    check_head_dim_contiguous("v_cache", v_cache)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected {num_seqs} rows (q's num_seqs), got shape {tuple(block_tables.shape)}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window: expected None or a positive int, got {sliding_window!r}")
    if soft_cap is not None and (
        isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float)) or not math.isfinite(soft_cap) or soft_cap <= 0
    ):
        raise ValueError(f"soft_cap: expected None or a positive finite number, got {soft_cap!r}")
    if num_splits is not None and (not _is_int(num_splits) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if not validate or num_seqs == 0:
        return None
    return _check_contents(block_tables, seq_lens, num_blocks, block_size, sliding_window)


def _check_contents(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int, sliding_window: int | None
) -> int:
    """The data checks: lengths fit their tables, and every block the kernel will read is in the pool."""
    lens = seq_lens.long()  # [num_seqs]
    shortest, longest = int(lens.min()), int(lens.max())
    if shortest < 0:
        raise ValueError(f"seq_lens: lengths must be >= 0, got {shortest}")
    capacity = block_tables.shape[1] * block_size
    if longest > capacity:
        seq = int(torch.argmax(lens))
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
    return longest


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
