"""The torch version of paged_decode_attention: gather each sequence's K/V through its block table, fp32 math.

It is what the Triton kernel is tested against and what CPU serving runs, so it stays plain: one
sequence at a time, no splits, no online softmax.
"""

from __future__ import annotations

import torch


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V (no argument checks).

    Shapes and meaning as `paged_decode_attention`; returns `[num_seqs, num_q_heads, head_dim]` in q's dtype.
    """
    num_seqs, num_q_heads, head_dim = q.shape  # q: [num_seqs, num_q_heads, head_dim]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]  # k_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    group_size = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)  # [num_seqs, num_q_heads, head_dim]
    for i, seq_len in enumerate(seq_lens.tolist()):
        start = max(0, seq_len - sliding_window) if sliding_window is not None else 0
        if seq_len <= start:
            continue
        first = start // block_size  # whole blocks gathered, then cut to [start, seq_len)
        block_ids = block_tables[i, first : -(-seq_len // block_size)].long()  # [num_read_blocks]
        cut = slice(start - first * block_size, seq_len - first * block_size)
        k = k_cache[block_ids].flatten(0, 1)[cut].float()  # [n, num_kv_heads, head_dim]
        v = v_cache[block_ids].flatten(0, 1)[cut].float()  # [n, num_kv_heads, head_dim]
        qi = q[i].float().reshape(num_kv_heads, group_size, head_dim)  # [num_kv_heads, group_size, head_dim]
        scores = (qi @ k.permute(1, 2, 0)) * scale  # [num_kv_heads, group_size, n]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.softmax(dim=-1)  # [num_kv_heads, group_size, n]
        out[i] = (probs @ v.transpose(0, 1)).reshape(num_q_heads, head_dim).to(q.dtype)
    return out
