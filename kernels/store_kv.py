"""store_kv: write new tokens' K and V into their slots of one layer's paged cache (vLLM's reshape_and_cache).

A slot is `block_id * block_size + offset`; a negative slot marks a padding token and is skipped. An
fp8 cache stores `value / scale` saturated to +-448 (e4m3's largest finite value): a large or infinite
value stores as +-448, never as NaN. A NaN stays NaN, on every path: it is the model's bug, and a cache
that turned it into a number would hide it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.backend import pick_backend
from radixkv.kernels.validate import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    FP8_MAX,
    check_kv_layer,
    check_kv_scales,
    check_shape,
    check_tensor,
    should_validate,
)

# Elements of one program's [heads, head_dim] tile: keeps the interpreter's program count low and a
# GPU program's registers modest.
_TILE_ELEMENTS = 2048


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    kv_scales_ptr,
    slots_ptr,
    num_kv_heads,
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_kv,
    stride_kv_b,
    stride_kv_t,
    stride_kv_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    QUANT_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)  # int64: block_id * stride cannot overflow
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)  # [HEADS_PER_PROGRAM]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    num_heads_written = tl.where(slot >= 0, num_kv_heads, 0)  # a padding token (slot < 0) writes nothing
    mask = (heads[:, None] < num_heads_written) & (dims[None, :] < HEAD_DIM)  # [HEADS_PER_PROGRAM, HEAD_DIM_PAD]

    key_ptrs = key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :] * stride_key_d
    key = tl.load(key_ptrs, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :] * stride_value_d, mask=mask
    )
    if QUANTIZE:  # divide, as the torch reference does, so both round the same fp32 quotient
        nan = tl.PropagateNan.ALL  # as torch.clamp: without it a GPU's min/max would turn NaN into a bound
        key = tl.clamp(key.to(tl.float32) / tl.load(kv_scales_ptr), -QUANT_MAX, QUANT_MAX, propagate_nan=nan)
        value = tl.clamp(value.to(tl.float32) / tl.load(kv_scales_ptr + 1), -QUANT_MAX, QUANT_MAX, propagate_nan=nan)
    dst = kv_ptr + block_id * stride_kv_b + offset * stride_kv_t + heads[:, None] * stride_kv_h + dims[None, :]
    tl.store(dst, key.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(kv_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    *,
    kv_scales: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool | None = None,
) -> None:
    """Write `key`/`value` of each token into slot `slots[i]` of one layer's K and V caches, in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, fp32/fp16/bf16.
        kv_layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K at 0, V at 1), as a worker's
            `PoolView.layer(l)`
            (or `KVStorage.layer(l)`) returns it; key's dtype, or fp8 e4m3 (quantized here).
        slots: int64 `[num_tokens]`; a negative slot skips its token (padding).
        kv_scales: fp32 `[2]` (k_scale, v_scale), with an fp8 kv_layer only: it stores `key / k_scale`.
        backend: "triton" or "torch" to force one; None picks (see `radixkv.kernels.backend`). fp8 on CPU
            always runs torch: the interpreter's conversion to fp8 neither saturates nor rounds right.
        validate: read `slots` to reject a slot beyond the pool; a device sync on CUDA, so None (the
            default) checks CPU tensors only. Shapes are always checked.

    Raises:
        ValueError: a malformed argument (the message starts with its name), or a slot beyond the pool.
    """
    _check_store_kv(key, value, kv_layer, slots, kv_scales, validate)
    if key.shape[0] == 0:
        return
    quantize = kv_layer.dtype == FP8_DTYPE
    on_cpu_fp8 = quantize and key.device.type == "cpu"
    if on_cpu_fp8 and backend == "triton":
        raise ValueError("backend: the Triton interpreter converts to fp8 wrongly; fp8 stores on CPU run torch")
    if on_cpu_fp8 or pick_backend(key.device, backend) == "torch":
        store_kv_reference(key, value, kv_layer, slots, kv_scales=kv_scales)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    head_dim_pad = triton.next_power_of_2(head_dim)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _store_kv_kernel[grid](
        key,
        value,
        kv_layer,
        kv_scales if quantize else slots,
        slots,
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        *kv_layer.stride()[:4],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_SIZE=kv_layer.shape[2],
        QUANTIZE=quantize,
        QUANT_MAX=FP8_MAX,
    )


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`x / scale` in fp8 e4m3, saturated to +-448 (NaN stays NaN): fp32 division, then one rounding to the nearest
    fp8 value."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    *,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """The torch version of `store_kv` (no argument checks): index the caches by (block, offset)."""
    block_size = kv_layer.shape[2]  # kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    keep = slots >= 0  # [num_tokens]
    kept = slots[keep]  # [num_kept]
    for i, x in enumerate((key[keep], value[keep])):  # [num_kept, num_kv_heads, head_dim] each
        stored = quantize_fp8(x, kv_scales[i]) if kv_scales is not None else x
        kv_layer[i, kept // block_size, kept % block_size] = stored


def _check_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: torch.Tensor | None,
    validate: bool | None,
) -> None:
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    device = key.device
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=device)
    check_shape("value", value, tuple(key.shape), "(the shape of key)")
    check_kv_layer(kv_layer, key.dtype, device)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    if tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key: expected [num_tokens, {num_kv_heads}, {head_dim}] to match the cache's heads and head_dim, "
            f"got {tuple(key.shape)}"
        )
    check_kv_scales(kv_scales, kv_layer)
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int64,), device=device)
    check_shape("slots", slots, (key.shape[0],), "[num_tokens]")
    if should_validate(validate, device) and slots.numel() > 0:
        max_slot = int(slots.max())
        if max_slot >= num_blocks * block_size:
            raise ValueError(
                f"slots: slot {max_slot} is beyond the pool ({num_blocks} blocks x {block_size} = "
                f"{num_blocks * block_size} slots)"
            )
