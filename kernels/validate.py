"""Argument checks shared by the launchers: each failure is a ValueError whose message starts with the argument's name.

Also the cache conventions every kernel shares: one layer's K and V as one tensor `kv_layer`
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (K at 0, V at 1: `KVStorage.layer(l)`), in q's
dtype or in fp8 e4m3 with `kv_scales` fp32 `[2]` (the layer's K and V scales: stored = value / scale).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value: quantizing saturates here instead of overflowing to NaN


def check_tensor(
    name: str, t: object, *, ndim: int, dtypes: Collection[torch.dtype], device: torch.device | None = None
) -> torch.Tensor:
    """`t` itself, once it is a tensor with `ndim` dims, a dtype in `dtypes`, and on `device` (when given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device} (the same as the other tensors), got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    """Raise unless `t.shape == expected`; `meaning` spells the axes, e.g. "[num_tokens, num_kv_heads, head_dim]"."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} {meaning}, got {tuple(t.shape)}")


def check_block_size(name: str, block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"{name}: block_size must be a power of two, got {block_size}")


def check_kv_layer(kv_layer: object, compute_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`kv_layer` itself, once it is `[2, num_blocks, block_size, num_kv_heads, head_dim]` in `compute_dtype` or fp8.

    The kernels address head_dim as consecutive elements, so a strided last axis is a layout bug.
    """
    kv_layer = check_tensor("kv_layer", kv_layer, ndim=5, dtypes=(compute_dtype, FP8_DTYPE), device=device)
    if kv_layer.shape[0] != 2:
        raise ValueError(f"kv_layer: axis 0 holds K and V and must be 2, got shape {tuple(kv_layer.shape)}")
    check_block_size("kv_layer", kv_layer.shape[2])
    if kv_layer.stride(-1) != 1:
        raise ValueError(f"kv_layer: the head_dim axis must be contiguous (stride 1), got strides {kv_layer.stride()}")
    return kv_layer


def check_kv_scales(kv_scales: object, kv_layer: torch.Tensor) -> torch.Tensor | None:
    """fp8 caches need their fp32 `[2]` scales (on the cache's device, read there: no host sync); others take none."""
    if kv_layer.dtype != FP8_DTYPE:
        if kv_scales is not None:
            raise ValueError(f"kv_scales: only an fp8 kv_layer is scaled, this one is {kv_layer.dtype}")
        return None
    if kv_scales is None:
        raise ValueError("kv_scales: an fp8 kv_layer needs its (k_scale, v_scale) as an fp32 tensor [2]")
    kv_scales = check_tensor("kv_scales", kv_scales, ndim=1, dtypes=(torch.float32,), device=kv_layer.device)
    check_shape("kv_scales", kv_scales, (2,), "[2] (k_scale, v_scale)")
    return kv_scales


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def should_validate(validate: bool | None, device: torch.device) -> bool:
    """Whether a launcher reads its index tensors to check them: always when asked, and by default (None) only
    on CPU, where it costs no device sync; on CUDA the default hot path never waits for the device."""
    return bool(validate) or (validate is None and device.type == "cpu")
