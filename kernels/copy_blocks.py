"""copy_blocks: apply copy-on-write instructions `(src_block, dst_block)` to every layer's K and V in one launch.

It copies bits (through an integer view of the pool), so every pool dtype, fp8 included, copies exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from radixkv.kernels.backend import pick_backend
from radixkv.kernels.step_tensors import host_to_device
from radixkv.kernels.validate import FLOAT_DTYPES, FP8_DTYPE, check_block_size, check_tensor, should_validate

# Elements one program copies: a block of 16 tokens x 8 heads x 128 dims is two programs.
_CHUNK = 8192
_BITS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}  # an integer dtype of each element size


@triton.jit
def _copy_blocks_kernel(
    kv_data_ptr,
    pairs_ptr,
    stride_layer,
    stride_kv,
    stride_block,
    stride_pair,
    stride_pair_col,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1)  # layer * 2 + (0 for K, 1 for V)
    src = tl.load(pairs_ptr + pair * stride_pair)  # int64
    dst = tl.load(pairs_ptr + pair * stride_pair + stride_pair_col)
    base = (layer_kv // 2).to(tl.int64) * stride_layer + (layer_kv % 2) * stride_kv
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    mask = offs < BLOCK_NUMEL
    data = tl.load(kv_data_ptr + base + src * stride_block + offs, mask=mask)
    tl.store(kv_data_ptr + base + dst * stride_block + offs, data, mask=mask)


def copy_blocks(
    kv_data: torch.Tensor,
    pairs: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    *,
    backend: str | None = None,
    validate: bool | None = None,
) -> None:
    """Copy block `src` onto block `dst` for each row of `pairs`, in every layer's K and V, in place.

    Args:
        kv_data: the whole pool `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; each
            block's `[block_size, num_kv_heads, head_dim]` must be contiguous (as a worker's `PoolView.data` is).
        pairs: int64 `[num_pairs, 2]` of `(src_block, dst_block)` on the pool's device, or what the core returns
            as it is, on the host: `AppendBatch.copies` (`(src, dst, sequence_index)` triples),
            `AppendResult.copies`, a numpy `StepArrays.copies`. Host pairs go to the pool's device through
            `host_to_device` (pinned, non-blocking: no host wait). Destinations must be distinct and not also
            sources, so the result does not depend on the order programs run in.
        backend: "triton" or "torch" to force one; None picks (see `radixkv.kernels.backend`).
        validate: read `pairs` to reject bad block ids. Host pairs are read where they are, at no device cost, so
            None (the default) checks them and CPU tensors; a CUDA tensor is read only when asked (a device sync).

    Raises:
        ValueError: a malformed argument (the message starts with its name), or a block id out of range.
    """
    _check_pool(kv_data)
    host = _host_pairs(pairs)
    if host is not None:
        if validate is not False:
            _check_block_ids(kv_data, torch.from_numpy(host))
        (on_device,) = host_to_device([host], kv_data.device)  # int64 [num_pairs, 2]
    else:
        on_device = check_tensor("pairs", pairs, ndim=2, dtypes=(torch.int64,), device=kv_data.device)
        if on_device.shape[1] != 2:
            raise ValueError(
                f"pairs: expected shape [num_pairs, 2] of (src_block, dst_block), got {tuple(on_device.shape)}"
            )
        if should_validate(validate, kv_data.device):
            _check_block_ids(kv_data, on_device)
    chosen = pick_backend(kv_data.device, backend)
    if on_device.shape[0] == 0:
        return
    if chosen == "torch":
        copy_blocks_reference(kv_data, on_device)
        return
    kv_data = kv_data.view(_BITS[kv_data.element_size()])
    num_layers = kv_data.shape[0]
    block_numel = kv_data[0, 0, 0].numel()
    chunk = min(triton.next_power_of_2(block_numel), _CHUNK)
    grid = (on_device.shape[0], num_layers * 2, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        kv_data,
        on_device,
        kv_data.stride(0),
        kv_data.stride(1),
        kv_data.stride(2),
        *on_device.stride(),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
    )


def copy_blocks_reference(kv_data: torch.Tensor, pairs: torch.Tensor) -> None:
    """The torch version of `copy_blocks` (no argument checks): gather every source, then scatter."""
    src, dst = pairs[:, 0], pairs[:, 1]  # [num_pairs] each
    kv_data[:, :, dst] = kv_data[:, :, src]


def _host_pairs(pairs: object) -> np.ndarray | None:
    """The core's lists and numpy arrays as int64 `[n, 2]` numpy; None for a tensor (the checks judge it)."""
    if isinstance(pairs, torch.Tensor):
        return None
    if isinstance(pairs, np.ndarray):
        if pairs.dtype != np.int64:
            raise ValueError(f"pairs: expected an int64 array, got {pairs.dtype}")
        if pairs.ndim != 2 or pairs.shape[1] != 2:
            raise ValueError(f"pairs: expected an array [num_pairs, 2] of (src_block, dst_block), got {pairs.shape}")
        return pairs
    if not isinstance(pairs, Sequence) or any(
        not isinstance(p, Sequence) or len(p) not in (2, 3) or not all(isinstance(b, int) for b in p) for p in pairs
    ):
        raise ValueError(
            "pairs: expected an int64 tensor [n, 2], or (src, dst) pairs / (src, dst, index) triples of ints"
        )
    return np.array([(p[0], p[1]) for p in pairs], dtype=np.int64).reshape(-1, 2)


def _check_pool(kv_data: object) -> None:
    kv_data = check_tensor("kv_data", kv_data, ndim=6, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    if kv_data.shape[1] != 2:
        raise ValueError(f"kv_data: axis 1 holds K and V and must be 2, got shape {tuple(kv_data.shape)}")
    _, _, _, block_size, num_kv_heads, head_dim = kv_data.shape
    check_block_size("kv_data", block_size)
    if kv_data.stride()[3:] != (num_kv_heads * head_dim, head_dim, 1):
        raise ValueError(f"kv_data: each block must be contiguous, got strides {kv_data.stride()}")


def _check_block_ids(kv_data: torch.Tensor, pairs: torch.Tensor) -> None:
    """Block ids in the pool; destinations distinct and never sources (reads `pairs`: a sync on CUDA)."""
    if pairs.shape[0] == 0:
        return
    num_blocks = kv_data.shape[2]
    low, high = int(pairs.min()), int(pairs.max())
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise ValueError(f"pairs: block id {bad} is out of range for a pool of {num_blocks} blocks")
    dst = pairs[:, 1]
    if torch.unique(dst).numel() != dst.numel() or bool(torch.isin(dst, pairs[:, 0]).any()):
        raise ValueError("pairs: destination blocks must be distinct and must not also be sources")
