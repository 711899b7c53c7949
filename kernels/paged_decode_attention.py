"""paged_decode_attention: one query token per sequence against its K/V in a paged cache (flash-decoding).

The kernels (`radixkv.kernels.decode_kernels`) cut each sequence into the splits of the step's
`DecodePlan` (`radixkv.kernels.decode_plan`), one program per (sequence, KV head, split), and merge the
splits' partials in a second launch; with one split the first launch writes the output directly.

fp8 e4m3 caches are read with their scales folded in: `k_scale` into the score scale, `v_scale` into
the output. The hot path (`validate=False`, the default on CUDA, with a `DecodePlan` made from host-side
lengths) reads nothing back from the device.

In this file: the launches, the launcher that checks before launching, the torch reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton

from radixkv.kernels.backend import pick_backend
from radixkv.kernels.decode_checks import check_decode_args, check_decode_contents
from radixkv.kernels.decode_kernels import decode_merge_kernel, decode_split_kernel
from radixkv.kernels.decode_plan import DecodePlan, plan_decode
from radixkv.kernels.validate import FP8_DTYPE, should_validate

# ---------------------------------------------------------------------------------------------------- launches


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """One kernel launch, `kernel[grid](*args, **meta)`: what the launcher runs and what
    `benchmarks/kernel_resources.py` compiles for a GPU it does not have."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]


def decode_launches(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    plan: DecodePlan,
    *,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> list[Launch]:
    """The launches of one call on checked arguments: the split kernel, then the merge kernel when the plan splits.

    `out` `[num_seqs, num_q_heads, head_dim]` (contiguous, q's dtype) receives the result.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    split = plan.part_ml is not None
    group_size = num_q_heads // num_kv_heads
    launches = [
        Launch(
            kernel=decode_split_kernel,
            grid=(num_seqs, num_kv_heads, plan.num_splits),
            args=(
                q,
                kv_layer,
                kv_scales if kv_scales is not None else seq_lens,
                block_tables,
                seq_lens,
                out,
                plan.part_ml if split else out,
                plan.part_acc if split else out,
                float(scale),
                float(soft_cap or 1.0),
                int(sliding_window or 0),
                plan.split_len,
                *q.stride(),
                *kv_layer.stride()[:4],
                *block_tables.stride(),
                seq_lens.stride(0),
                out.stride(0),
                out.stride(1),
            ),
            meta=dict(
                GROUP_SIZE=group_size,
                GROUP_PAD=max(16, triton.next_power_of_2(group_size)),
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_SIZE=block_size,
                TILE_N=plan.config.tile_n,
                USE_SOFT_CAP=soft_cap is not None,
                USE_WINDOW=sliding_window is not None,
                USE_KV_SCALES=kv_layer.dtype == FP8_DTYPE,
                SPLIT=split,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 gets fp32 products, not tf32
                num_warps=plan.config.num_warps,
                num_stages=plan.config.num_stages,
            ),
        )
    ]
    if split:
        launches.append(
            Launch(
                kernel=decode_merge_kernel,
                grid=(num_seqs, num_q_heads),
                args=(
                    plan.part_ml,
                    plan.part_acc,
                    seq_lens,
                    out,
                    int(sliding_window or 0),
                    plan.split_len,
                    plan.num_splits,
                    seq_lens.stride(0),
                    out.stride(0),
                    out.stride(1),
                ),
                meta=dict(
                    HEAD_DIM=head_dim,
                    HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                    SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
                    USE_WINDOW=sliding_window is not None,
                    num_warps=4,
                ),
            )
        )
    return launches


# ---------------------------------------------------------------------------------------------------- launcher


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    plan: DecodePlan | None = None,
    backend: str | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its first `seq_lens[i]` cached tokens.

    Args:
        q: `[num_seqs, num_q_heads, head_dim]`, fp32/fp16/bf16; head_dim <= 256.
        kv_layer: one layer's K and V `[2, num_blocks, block_size, num_kv_heads, head_dim]`
            (a worker's `PoolView.layer(l)`),
            in q's dtype or fp8 e4m3; num_q_heads must be a multiple of num_kv_heads (MHA, GQA, MQA).
        block_tables: int32 `[num_seqs, max_blocks_per_seq]`; row i lists sequence i's blocks in order.
        seq_lens: int32 `[num_seqs]`; 0 gives a zero output row.
        scale: the softmax scale, usually `head_dim ** -0.5`.
        kv_scales: fp32 `[2]` (k_scale, v_scale) on the cache's device, with an fp8 kv_layer only.
        sliding_window: attend only to the last `sliding_window` tokens.
        soft_cap: logits become `soft_cap * tanh(logits / soft_cap)` before the softmax (Gemma-2).
        num_splits: at most this many splits of the longest sequence (tests, benchmarks); see `plan_decode`.
        plan: `plan_decode(...)` for this batch, made once per step from host-side lengths: its split
            length and scratch serve every layer. Without one, the launcher plans from the lengths it
            validated, or else assumes every sequence fills its block table.
        backend: "triton" or "torch" to force one; None picks (see `radixkv.kernels.backend`).
        validate: read `seq_lens` and `block_tables` to reject bad lengths and block ids. A device sync on
            CUDA (and impossible under CUDA-graph capture), so None, the default, checks on CPU tensors
            only; True is the debug option on CUDA.

    Returns:
        `[num_seqs, num_q_heads, head_dim]` in q's dtype.

    Raises:
        ValueError: a malformed argument (the message starts with its name); when validating, also a
            block id out of range or a sequence longer than its block table.
    """
    check_decode_args(q, kv_layer, block_tables, seq_lens, scale, kv_scales, sliding_window, soft_cap, num_splits, plan)
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
    host_lens = None
    if should_validate(validate, q.device):
        host_lens = check_decode_contents(block_tables, seq_lens, num_blocks, block_size, sliding_window)
    if pick_backend(q.device, backend) == "torch":
        return paged_decode_attention_reference(
            q,
            kv_layer,
            block_tables,
            seq_lens,
            scale,
            kv_scales=kv_scales,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [num_seqs, num_q_heads, head_dim]
    if num_seqs == 0:
        return out
    if plan is None:
        assumed = host_lens if host_lens is not None else [block_tables.shape[1] * block_size] * num_seqs
        plan = plan_decode(
            assumed,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            cache_dtype=kv_layer.dtype,
            device=q.device,
            sliding_window=sliding_window,
            num_splits=num_splits,
        )
    for launch in decode_launches(
        q,
        kv_layer,
        block_tables,
        seq_lens,
        out,
        scale,
        plan,
        kv_scales=kv_scales,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    ):
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    return out


# ---------------------------------------------------------------------------------------------------- reference


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """The torch version (no argument checks): gather each sequence's K/V by its block table, dequantize, fp32 math.

    What the Triton kernel is tested against and what CPU serving runs, so it stays plain: one sequence
    at a time, no splits, no online softmax. Shapes and meaning as `paged_decode_attention`.
    """
    num_seqs, num_q_heads, head_dim = q.shape  # q: [num_seqs, num_q_heads, head_dim]
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]  # kv_layer: [2, num_blocks, block_size, H, D]
    group_size = num_q_heads // num_kv_heads
    k_scale, v_scale = kv_scales.float() if kv_scales is not None else (1.0, 1.0)
    out = torch.zeros_like(q)  # [num_seqs, num_q_heads, head_dim]
    for i, seq_len in enumerate(seq_lens.tolist()):
        start = max(0, seq_len - sliding_window) if sliding_window is not None else 0
        if seq_len <= start:
            continue
        first = start // block_size  # whole blocks gathered, then cut to [start, seq_len)
        block_ids = block_tables[i, first : -(-seq_len // block_size)].long()  # [num_read_blocks]
        cut = slice(start - first * block_size, seq_len - first * block_size)
        k = kv_layer[0, block_ids].flatten(0, 1)[cut].float() * k_scale  # [n, num_kv_heads, head_dim]
        v = kv_layer[1, block_ids].flatten(0, 1)[cut].float() * v_scale  # [n, num_kv_heads, head_dim]
        qi = q[i].float().reshape(num_kv_heads, group_size, head_dim)  # [num_kv_heads, group_size, head_dim]
        scores = (qi @ k.permute(1, 2, 0)) * scale  # [num_kv_heads, group_size, n]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.softmax(dim=-1)  # [num_kv_heads, group_size, n]
        out[i] = (probs @ v.transpose(0, 1)).reshape(num_q_heads, head_dim).to(q.dtype)
    return out
