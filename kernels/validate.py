"""Argument checks shared by the launchers: each failure is a ValueError whose message starts with the argument's name."""

from __future__ import annotations

from collections.abc import Collection

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    """Raise unless `t.shape == expected`; `meaning` spells the expected axes, e.g. "[num_tokens, num_kv_heads, head_dim]"."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} {meaning}, got {tuple(t.shape)}")


def check_head_dim_contiguous(name: str, cache: torch.Tensor) -> None:
    """The kernels address head_dim as consecutive elements: a cache whose last axis is strided is a layout bug."""
    if cache.stride(-1) != 1:
        raise ValueError(f"{name}: the head_dim axis must be contiguous (stride 1), got strides {cache.stride()}")


def check_block_size(name: str, block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"{name}: block_size (axis 1) must be a power of two, got {block_size}")
