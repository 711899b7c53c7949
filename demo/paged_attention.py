"""Attention over the paged pool: prefill of a prompt's uncached tail, and one-token decode.

Both write the batch's new K/V into their slots with `store_kv` first, then read K/V only from the
pool, through block tables: prefill gathers the cached prefix plus its own tokens and runs causal
SDPA (torch); decode calls the `paged_decode_attention` kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F

from radixkv.kernels import paged_decode_attention, store_kv


class PoolMemory(Protocol):
    """The pool's tensors as a worker sees them: `KVStorage`, or `PoolView` mapping the server's pool."""

    @property
    def data(self) -> torch.Tensor: ...  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # k, v: [num_blocks, block_size, num_kv_heads, head_dim]


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One sequence of a prefill batch: its tokens from `num_cached_tokens` on are computed now."""

    block_table: list[int]
    num_cached_tokens: int
    num_new_tokens: int


class PagedPrefill:
    """Prefill attention for several sequences whose new tokens lie back to back in the batch."""

    def __init__(
        self,
        pool: PoolMemory,
        seqs: list[PrefillSeq],
        slots: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        backend: str | None = None,
    ) -> None:
        # slots: int64 [num_tokens], the new tokens' slots in batch order
        self.pool, self.seqs, self.slots = pool, seqs, slots
        self.scale, self.sliding_window, self.backend = scale, sliding_window, backend
        block_size = pool.data.shape[3]
        self.context_slots: list[torch.Tensor] = []  # per sequence: int64 [num_context], slots of positions 0..end
        self.masks: list[torch.Tensor] = []  # per sequence: bool [num_new, num_context], True = may attend
        for seq in seqs:
            end = seq.num_cached_tokens + seq.num_new_tokens
            positions = torch.arange(end)  # [num_context]
            table = torch.tensor(seq.block_table, dtype=torch.int64)  # [num_blocks_in_table]
            self.context_slots.append(table[positions // block_size] * block_size + positions % block_size)
            query_pos = positions[seq.num_cached_tokens :, None]  # [num_new, 1]
            mask = positions[None, :] <= query_pos  # [num_new, num_context]
            if sliding_window is not None:
                mask &= positions[None, :] > query_pos - sliding_window
            self.masks.append(mask)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        k_cache, v_cache = self.pool.layer(layer)  # [num_blocks, block_size, num_kv_heads, head_dim] each
        store_kv(k.to(k_cache.dtype), v.to(v_cache.dtype), (k_cache, v_cache), self.slots, backend=self.backend)
        k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_slots, num_kv_heads, head_dim] each
        out = torch.empty_like(q)  # [num_tokens, num_q_heads, head_dim]
        start = 0
        for seq, context_slots, mask in zip(self.seqs, self.context_slots, self.masks, strict=True):
            stop = start + seq.num_new_tokens
            qs = q[start:stop].transpose(0, 1)  # [num_q_heads, num_new, head_dim]
            ks = k_flat[context_slots].to(q.dtype).transpose(0, 1)  # [num_kv_heads, num_context, head_dim]
            vs = v_flat[context_slots].to(q.dtype).transpose(0, 1)  # [num_kv_heads, num_context, head_dim]
            attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start:stop] = attended.transpose(0, 1)  # [num_new, num_q_heads, head_dim]
            start = stop
        return out


class PagedDecode:
    """Decode attention: one new token per sequence, attending to everything its block table holds."""

    def __init__(
        self,
        pool: PoolMemory,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        backend: str | None = None,
    ) -> None:
        # slots: int64 [num_seqs]; block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs], new token included
        self.pool, self.slots, self.block_tables, self.seq_lens = pool, slots, block_tables, seq_lens
        self.scale, self.sliding_window, self.backend = scale, sliding_window, backend

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_seqs, num_q_heads, head_dim]; k, v: [num_seqs, num_kv_heads, head_dim]
        k_cache, v_cache = self.pool.layer(layer)  # [num_blocks, block_size, num_kv_heads, head_dim] each
        store_kv(k.to(k_cache.dtype), v.to(v_cache.dtype), (k_cache, v_cache), self.slots, backend=self.backend)
        out = paged_decode_attention(
            q.to(k_cache.dtype), k_cache, v_cache, self.block_tables, self.seq_lens, self.scale,
            sliding_window=self.sliding_window, backend=self.backend,
        )  # [num_seqs, num_q_heads, head_dim]
        return out.to(q.dtype)
