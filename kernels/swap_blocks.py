"""swap_blocks: copy whole blocks between two pools (device <-> host tier), every layer's K and V in one launch.

The core's offload `(device_block, host_block)` and load `(host_block, device_block)` instructions are applied
with it: `swap_blocks(device_pool, host_pool, offloads)` then `swap_blocks(host_pool, device_pool, loads)`.
On CPU (the torch path) each block is one strided `copy_` of its layers' K and V.
On CUDA the host pool is pinned memory, which a kernel reads and writes directly (unified virtual addressing):
one Triton launch on a side stream gathers every block, however scattered, with no staging copy and no per-block
`cudaMemcpy` call; the caller waits on the returned event before its step reads the blocks. It copies bits
(through an integer view of the pool), so every pool dtype, fp8 included, copies exactly.
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

_CHUNK = 8192  # elements one program copies
_BITS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the stream every swap on it runs on


@triton.jit
def _swap_blocks_kernel(
    src_ptr,
    dst_ptr,
    pairs_ptr,
    src_stride_layer,
    src_stride_kv,
    src_stride_block,
    dst_stride_layer,
    dst_stride_kv,
    dst_stride_block,
    stride_pair,
    stride_pair_col,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1)  # layer * 2 + (0 for K, 1 for V)
    layer, kv = (layer_kv // 2).to(tl.int64), (layer_kv % 2).to(tl.int64)
    src = tl.load(pairs_ptr + pair * stride_pair)  # int64
    dst = tl.load(pairs_ptr + pair * stride_pair + stride_pair_col)
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    mask = offs < BLOCK_NUMEL
    src_base = layer * src_stride_layer + kv * src_stride_kv + src * src_stride_block
    dst_base = layer * dst_stride_layer + kv * dst_stride_kv + dst * dst_stride_block
    data = tl.load(src_ptr + src_base + offs, mask=mask)
    tl.store(dst_ptr + dst_base + offs, data, mask=mask)


def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    pairs: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    *,
    backend: str | None = None,
    validate: bool | None = None,
) -> torch.cuda.Event | None:
    """Copy block `s` of pool `src` onto block `d` of pool `dst` for each row `(s, d)` of `pairs`, all layers, K and V.

    Args:
        src, dst: whole pools `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` of one dtype and
            block shape (their `num_blocks` may differ): a device pool and a host pool, or two CPU pools. A CPU
            pool swapped with a CUDA pool must be pinned (`KVStorage.create_host` pins it when CUDA is present).
        pairs: int64 `[num_pairs, 2]` of `(src_block, dst_block)`, or the core's lists of pairs as they are.
            Host pairs reach a CUDA pool's device through `host_to_device` (pinned, non-blocking). Destinations
            must be distinct, so the result does not depend on the order programs run in.
        backend: "triton" or "torch" to force one; None picks (Triton when either pool is on CUDA).
        validate: read `pairs` to reject bad block ids; by default (None) unless `pairs` is already on CUDA
            (reading it there would wait for the device).

    Returns:
        With a CUDA pool: an event recorded on the side stream after the copies, which the caller waits on
        (`event.wait()` on its compute stream, or `event.synchronize()`) before reading `dst`. The copies wait
        for work already queued on the current stream. Without one: None, and the copies are done.

    Raises:
        ValueError: a malformed argument (the message starts with its name), or a block id out of range.
    """
    cuda = next((t.device for t in (src, dst) if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
    pairs = _as_pairs(pairs)
    _check_swap_blocks(src, dst, pairs, cuda, validate)
    if cuda is not None and pairs.device.type == "cpu":
        (pairs,) = host_to_device([pairs.numpy()], cuda)  # pinned and non-blocking: the host never waits
    chosen = pick_backend(cuda or src.device, backend)
    if cuda is None:
        if pairs.shape[0]:
            _run(src, dst, pairs, chosen)
        return None
    side = _side_stream(cuda)
    side.wait_stream(torch.cuda.current_stream(cuda))  # the blocks' last writes land before they are read
    with torch.cuda.device(cuda), torch.cuda.stream(side):
        if pairs.shape[0]:
            _run(src, dst, pairs, chosen)
        event = torch.cuda.Event()
        event.record(side)
    for t in (src, dst, pairs):  # the caller's stream may free or reuse them while the side stream still copies
        if t.device.type == "cuda":
            t.record_stream(side)
    return event


def swap_blocks_reference(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """The torch version of `swap_blocks` (no argument checks): gather the sources, scatter them into `dst`."""
    src_ids, dst_ids = pairs[:, 0], pairs[:, 1]  # [num_pairs] each
    bits = _BITS[src.element_size()]  # index_copy_ has no fp8 kernel; bits copy every dtype exactly
    src, dst = src.view(bits), dst.view(bits)
    gathered = src.index_select(2, src_ids.to(src.device))  # [num_layers, 2, num_pairs, block_size, H, D]
    dst.index_copy_(2, dst_ids.to(dst.device), gathered.to(dst.device))


def _run(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, backend: str) -> None:
    if backend == "torch":
        # One strided copy_ per block (its layers' K and V: memcpy-sized runs): on CPU about 10x the bandwidth
        # of index_select + index_copy_ along the block axis (benchmarks/bench_swap_blocks.py).
        for s, d in pairs.tolist():
            dst[:, :, d].copy_(src[:, :, s])
        return
    bits = _BITS[src.element_size()]
    src, dst = src.view(bits), dst.view(bits)
    block_numel = src[0, 0, 0].numel()
    chunk = min(triton.next_power_of_2(block_numel), _CHUNK)
    grid = (pairs.shape[0], src.shape[0] * 2, triton.cdiv(block_numel, chunk))
    _swap_blocks_kernel[grid](
        src, dst, pairs, *src.stride()[:3], *dst.stride()[:3], *pairs.stride(), BLOCK_NUMEL=block_numel, CHUNK=chunk
    )


def _as_pairs(pairs: object) -> torch.Tensor:
    """A tensor as it is (the checks judge it); the core's lists of pairs and numpy arrays as int64 `[n, 2]` on CPU."""
    if isinstance(pairs, torch.Tensor):
        return pairs
    if isinstance(pairs, np.ndarray):
        if pairs.dtype != np.int64:
            raise ValueError(f"pairs: expected an int64 array, got {pairs.dtype}")
        return torch.from_numpy(pairs)
    if not isinstance(pairs, Sequence) or any(
        not isinstance(p, Sequence) or len(p) != 2 or not all(isinstance(b, int) for b in p) for p in pairs
    ):
        raise ValueError("pairs: expected an int64 tensor [n, 2], or (src, dst) pairs of ints")
    return torch.tensor([tuple(p) for p in pairs], dtype=torch.int64).reshape(-1, 2)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


def _check_pool(name: str, pool: object) -> None:
    pool = check_tensor(name, pool, ndim=6, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    if pool.shape[1] != 2:
        raise ValueError(f"{name}: axis 1 holds K and V and must be 2, got shape {tuple(pool.shape)}")
    check_block_size(name, pool.shape[3])
    block_size, num_kv_heads, head_dim = pool.shape[3:]
    if pool.stride()[3:] != (num_kv_heads * head_dim, head_dim, 1):
        raise ValueError(f"{name}: each block must be contiguous, got strides {pool.stride()}")


def _check_swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, cuda: torch.device | None, validate: bool | None
) -> None:
    _check_pool("src", src)
    _check_pool("dst", dst)
    if dst.dtype != src.dtype:
        raise ValueError(f"dst: dtype {dst.dtype} differs from src's {src.dtype}")
    if (dst.shape[0], *dst.shape[3:]) != (src.shape[0], *src.shape[3:]):
        raise ValueError(f"dst: shape {tuple(dst.shape)} differs from src's {tuple(src.shape)} beyond num_blocks")
    for name, pool in (("src", src), ("dst", dst)):
        if cuda is not None and pool.device.type == "cpu" and not pool.is_pinned():
            raise ValueError(f"{name}: a host pool swapped with a CUDA pool must be pinned memory")
        if pool.device.type not in ("cpu", "cuda") or (cuda is not None and pool.is_cuda and pool.device != cuda):
            raise ValueError(f"{name}: expected the CPU or the one CUDA device {cuda}, got {pool.device}")
    check_tensor("pairs", pairs, ndim=2, dtypes=(torch.int64,))
    if pairs.device.type not in ("cpu", "cuda") or (pairs.is_cuda and pairs.device != cuda):
        raise ValueError(f"pairs: expected the CPU or the pools' CUDA device, got {pairs.device}")
    if pairs.shape[1] != 2:
        raise ValueError(f"pairs: expected shape [num_pairs, 2] of (src_block, dst_block), got {tuple(pairs.shape)}")
    if not should_validate(validate, pairs.device) or pairs.shape[0] == 0:
        return
    for column, pool, name in ((0, src, "src"), (1, dst, "dst")):
        ids = pairs[:, column]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= pool.shape[2]:
            bad = low if low < 0 else high
            raise ValueError(f"pairs: {name} block id {bad} is out of range for a pool of {pool.shape[2]} blocks")
    if torch.unique(pairs[:, 1]).numel() != pairs.shape[0]:
        raise ValueError("pairs: destination blocks must be distinct")
