"""Attention over the paged pool: prefill of a prompt's uncached tail, and one-token decode.

Both write the batch's new K/V into their slots with `store_kv` first, then read K/V only from the
pool, through block tables: prefill gathers the cached prefix plus its own tokens and runs causal
SDPA (torch); decode calls the `paged_decode_attention` kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from radixkv.kernels import DecodePlan, host_to_device, paged_decode_attention, plan_decode, store_kv


class PoolMemory(Protocol):
    """The pool's tensors as a worker sees them: `KVStorage`, or `PoolView` mapping the server's pool."""

    @property
    def data(self) -> torch.Tensor: ...  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

    def layer(self, layer: int) -> torch.Tensor: ...  # kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]

    def kv_scales(self, layer: int) -> torch.Tensor | None: ...  # fp32 [2] (k_scale, v_scale) of an fp8 pool


def compute_dtype(kv_layer: torch.Tensor, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention runs in: the cache's, unless the cache is fp8 (then the model's)."""
    return model_dtype if kv_layer.element_size() == 1 else kv_layer.dtype


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
        *,
        seqs: list[PrefillSeq],
        slots: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        backend: str | None = None,
    ) -> None:
        # slots: int64 [num_tokens], the new tokens' slots in batch order, on the pool's device
        self.pool, self.seqs, self.slots = pool, seqs, slots
        self.scale, self.sliding_window, self.backend = scale, sliding_window, backend
        block_size = pool.data.shape[3]
        host: list[np.ndarray] = []  # per sequence: its context's slots, then its mask; staged in one copy
        for seq in seqs:
            end = seq.num_cached_tokens + seq.num_new_tokens
            positions = np.arange(end)  # [num_context]
            table = np.asarray(seq.block_table, dtype=np.int64)  # [num_blocks_in_table]
            host.append(table[positions // block_size] * block_size + positions % block_size)  # int64 [num_context]
            query_pos = positions[seq.num_cached_tokens :, None]  # [num_new, 1]
            mask = positions[None, :] <= query_pos  # bool [num_new, num_context], True = may attend
            if sliding_window is not None:
                mask &= positions[None, :] > query_pos - sliding_window
            host.append(mask)
        staged = host_to_device(host, slots.device)
        self.context_slots: list[torch.Tensor] = staged[0::2]
        self.masks: list[torch.Tensor] = staged[1::2]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        kv_layer = self.pool.layer(layer)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        kv_scales = self.pool.kv_scales(layer)  # fp32 [2] for an fp8 pool, else None
        dtype = compute_dtype(kv_layer, q.dtype)
        store_kv(k.to(dtype), v.to(dtype), kv_layer, self.slots, kv_scales=kv_scales, backend=self.backend)
        k_flat, v_flat = kv_layer.flatten(1, 2)  # [num_slots, num_kv_heads, head_dim] each
        k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)  # dequantize: stored x scale
        out = torch.empty_like(q)  # [num_tokens, num_q_heads, head_dim]
        start = 0
        for seq, context_slots, mask in zip(self.seqs, self.context_slots, self.masks, strict=True):
            stop = start + seq.num_new_tokens
            qs = q[start:stop].transpose(0, 1)  # [num_q_heads, num_new, head_dim]
            ks = (k_flat[context_slots].to(q.dtype) * k_scale).transpose(0, 1)  # [num_kv_heads, num_context, head_dim]
            vs = (v_flat[context_slots].to(q.dtype) * v_scale).transpose(0, 1)  # [num_kv_heads, num_context, head_dim]
            attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start:stop] = attended.transpose(0, 1)  # [num_new, num_q_heads, head_dim]
            start = stop
        return out


class PagedDecode:
    """Decode attention: one new token per sequence, attending to everything its block table holds.

    The step's plan (split length, scratch) is made once from the host-side lengths and serves every
    layer: no layer's call reads anything back from the device.
    """

    def __init__(
        self,
        pool: PoolMemory,
        *,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        host_seq_lens: list[int],
        scale: float,
        sliding_window: int | None = None,
        backend: str | None = None,
        num_q_heads: int,
        model_dtype: torch.dtype,
    ) -> None:
        # on the pool's device: slots int64 [num_seqs]; block_tables int32 [num_seqs, max_blocks]; seq_lens int32
        # [num_seqs] (new token included), whose host copy `host_seq_lens` the plan is made from
        device = block_tables.device
        self.pool, self.slots, self.block_tables, self.seq_lens = pool, slots, block_tables, seq_lens
        self.scale, self.sliding_window, self.backend = scale, sliding_window, backend
        _, _, _, _, num_kv_heads, head_dim = pool.data.shape
        self.plan: DecodePlan = plan_decode(
            host_seq_lens,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            cache_dtype=pool.data.dtype,
            device=device,
            sliding_window=sliding_window,
        )
        self.dtype = compute_dtype(pool.data, model_dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_seqs, num_q_heads, head_dim]; k, v: [num_seqs, num_kv_heads, head_dim]
        kv_layer = self.pool.layer(layer)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        kv_scales = self.pool.kv_scales(layer)  # fp32 [2] for an fp8 pool, else None
        store_kv(k.to(self.dtype), v.to(self.dtype), kv_layer, self.slots, kv_scales=kv_scales, backend=self.backend)
        out = paged_decode_attention(
            q.to(self.dtype),
            kv_layer,
            self.block_tables,
            self.seq_lens,
            self.scale,
            kv_scales=kv_scales,
            sliding_window=self.sliding_window,
            plan=self.plan,
            backend=self.backend,
        )  # [num_seqs, num_q_heads, head_dim]
        return out.to(q.dtype)
