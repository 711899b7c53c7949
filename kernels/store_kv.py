"""store_kv: write new tokens' K and V into their slots of one layer's paged cache (vLLM's reshape_and_cache).

A slot is `block_id * block_size + offset`; a negative slot marks a padding token and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.backend import pick_backend
from radixkv.kernels.validate import (
    FLOAT_DTYPES,
    check_block_size,
    check_head_dim_contiguous,
    check_shape,
    check_tensor,
)

# Elements of one program's [heads, head_dim] tile: keeps the interpreter's program count low and a
# GPU program's registers modest.
_TILE_ELEMENTS = 2048


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    num_kv_heads,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_t, stride_kc_h,
    stride_vc_b, stride_vc_t, stride_vc_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)  # int64: block_id * stride cannot overflow
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)  # [HEADS_PER_PROGRAM]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    num_heads_written = tl.where(slot >= 0, num_kv_heads, 0)  # a padding token (slot < 0) writes nothing
    mask = (heads[:, None] < num_heads_written) & (dims[None, :] < HEAD_DIM)  # [HEADS_PER_PROGRAM, HEAD_DIM_PAD]

    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :] * stride_key_d, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :] * stride_value_d, mask=mask
    )
    k_dst = k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_t + heads[:, None] * stride_kc_h + dims[None, :]
    v_dst = v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_t + heads[:, None] * stride_vc_h + dims[None, :]
    tl.store(k_dst, key, mask=mask)
    tl.store(v_dst, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    *,
    backend: str | None = None,
    validate: bool = True,
) -> None:
    """Write `key`/`value` of each token into slot `slots[i]` of one layer's K and V caches, in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, the caches' dtype.
        kv_layer: `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`, as
            a worker's `PoolView.layer(l)` returns them.
        slots: int64 `[num_tokens]`; a negative slot skips its token (padding).
        backend: "triton" or "torch" to force one; None picks (see `radixkv.kernels.backend`).
        validate: False skips the check that reads `slots` (a device sync on CUDA); shapes are always checked.

    Raises:
        ValueError: a malformed argument (the message starts with its name), or a slot beyond the pool.
    """
    k_cache, v_cache = _check_store_kv(key, value, kv_layer, slots, validate)
    if key.shape[0] == 0:
        return
    if pick_backend(key.device, backend) == "torch":
        store_kv_reference(key, value, (k_cache, v_cache), slots)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    head_dim_pad = triton.next_power_of_2(head_dim)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slots,
        num_kv_heads,
        *key.stride(), *value.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEADS_PER_PROGRAM=heads_per_program, BLOCK_SIZE=k_cache.shape[1],
    )


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_layer: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor
) -> None:
    """The torch version of `store_kv` (no argument checks): index the caches by (block, offset)."""
    k_cache, v_cache = kv_layer  # [num_blocks, block_size, num_kv_heads, head_dim] each
    block_size = k_cache.shape[1]
    keep = slots >= 0  # [num_tokens]
    kept = slots[keep]  # [num_kept]
    k_cache[kept // block_size, kept % block_size] = key[keep]
    v_cache[kept // block_size, kept % block_size] = value[keep]


def _check_store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, validate: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    device = key.device
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=device)
    check_shape("value", value, tuple(key.shape), "(the shape of key)")
    if not isinstance(kv_layer, (tuple, list)) or len(kv_layer) != 2:
        raise ValueError(f"kv_layer: expected a (k_cache, v_cache) pair, got {type(kv_layer).__name__}")
    k_cache = check_tensor("kv_layer[0]", kv_layer[0], ndim=4, dtypes=(key.dtype,), device=device)
    v_cache = check_tensor("kv_layer[1]", kv_layer[1], ndim=4, dtypes=(key.dtype,), device=device)
    check_shape("kv_layer[1]", v_cache, tuple(k_cache.shape), "(the shape of kv_layer[0])")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    check_block_size("kv_layer[0]", block_size)
    if tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key: expected [num_tokens, {num_kv_heads}, {head_dim}] to match the cache's heads and head_dim, "
            f"got {tuple(key.shape)}"
        )
    check_head_dim_contiguous("kv_layer[0]", k_cache)
    check_head_dim_contiguous("kv_layer[1]", v_cache)
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int64,), device=device)
    check_shape("slots", slots, (key.shape[0],), "[num_tokens]")
    if validate and slots.numel() > 0:
        max_slot = int(slots.max())
        if max_slot >= num_blocks * block_size:
            raise ValueError(
                f"slots: slot {max_slot} is beyond the pool ({num_blocks} blocks x {block_size} = "
                f"{num_blocks * block_size} slots)"
            )
    return k_cache, v_cache
