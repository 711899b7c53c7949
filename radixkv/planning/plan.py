"""Capacity arithmetic a serving team runs before deploying: how much KV fits, in blocks and sequences."""

from __future__ import annotations

import dataclasses

from radixkv.memory.block_pool import cdiv
from radixkv.memory.layout import DTYPE_BYTES, canonical_dtype
from radixkv.planning.model_shape import MODEL_SHAPES, ModelShape

GIB = 2**30
MIB = 2**20
GB = 10**9

__all__ = [
    "GB",
    "GIB",
    "MIB",
    "MODEL_SHAPES",
    "CapacityPlan",
    "ModelShape",
    "format_plan",
    "parse_bytes",
    "plan_capacity",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CapacityPlan:
    # What the plan assumed, echoed back so nobody reads a figure without its premises.
    shape: ModelShape
    dtype: str
    block_size: int
    device_memory_bytes: int
    memory_utilization: float
    weight_bytes: int
    # What follows from them.
    bytes_per_token: int
    bytes_per_block: int
    kv_budget_bytes: int
    num_blocks: int
    max_tokens: int
    context_len: int
    bytes_per_sequence: int  # at context_len, in whole blocks
    max_sequences: int  # at context_len, all of them at once, no prefix sharing


def plan_capacity(
    shape: ModelShape,
    *,
    device_memory_bytes: int,
    memory_utilization: float = 0.9,
    weight_bytes: int = 0,
    block_size: int = 16,
    context_len: int = 4096,
    dtype: str = "float16",
) -> CapacityPlan:
    """KV bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes; blocks = floor(budget / block bytes).

    The budget is device memory x utilisation - weights, as vLLM's `--gpu-memory-utilization`.
    """
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must lie in (0, 1], got {memory_utilization}")
    if block_size < 1 or context_len < 1:
        raise ValueError("block_size and context_len must be positive")
    dtype = canonical_dtype(dtype)  # "fp8" is e4m3: half fp16's bytes, twice its blocks
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]
    bytes_per_block = bytes_per_token * block_size
    budget = int(device_memory_bytes * memory_utilization) - weight_bytes
    if budget <= 0:
        raise ValueError(
            f"no memory left for KV: {device_memory_bytes} x {memory_utilization} - {weight_bytes} weights"
        )
    num_blocks = budget // bytes_per_block
    blocks_per_sequence = cdiv(context_len, block_size)
    return CapacityPlan(
        shape=shape,
        dtype=dtype,
        block_size=block_size,
        device_memory_bytes=device_memory_bytes,
        memory_utilization=memory_utilization,
        weight_bytes=weight_bytes,
        bytes_per_token=bytes_per_token,
        bytes_per_block=bytes_per_block,
        kv_budget_bytes=budget,
        num_blocks=num_blocks,
        max_tokens=num_blocks * block_size,
        context_len=context_len,
        bytes_per_sequence=blocks_per_sequence * bytes_per_block,
        max_sequences=num_blocks // blocks_per_sequence,
    )


def parse_bytes(text: str) -> int:
    """'80GiB' (2^30), '80GB' (10^9, as SI and disk vendors write it), '512MiB' -> bytes; '0' alone needs no unit.

    Raises:
        ValueError: not a size, or a number without a unit (80 could be bytes or GiB: it says which to write).
    """
    units = {"tib": 2**40, "tb": 10**12, "gib": GIB, "gb": GB, "mib": MIB, "mb": 10**6, "kib": 1024, "kb": 1000, "b": 1}
    cleaned = text.strip().lower().replace(" ", "")
    unit = next((u for u in units if cleaned.endswith(u)), "")
    number, factor = cleaned[: len(cleaned) - len(unit)], units.get(unit, 1)
    try:
        value = float(number) * factor
    except ValueError:
        raise ValueError(
            f"{text!r} is not a size: write e.g. 80GiB (2^30 bytes), 80GB (10^9 bytes) or 512MiB"
        ) from None
    if value < 0:
        raise ValueError(f"{text!r}: a size must be >= 0")
    if not unit and value != 0:
        raise ValueError(f"{text!r} has no unit: write {number}GiB (2^30 bytes) or {number}GB (10^9 bytes)")
    return int(value)


def format_bytes(num_bytes: int) -> str:
    """Both units, so nobody mistakes one for the other: '80.00 GiB (85.90 GB)'."""
    return f"{num_bytes / GIB:.2f} GiB ({num_bytes / GB:.2f} GB)"


def pool_flag(plan: CapacityPlan, *, name: str = "default", device: str = "cuda") -> str:
    """The `radixkv serve --pool` value that serves this plan: its shape, dtype, block size and block count."""
    shape = plan.shape
    return (
        f"{name}:num_layers={shape.num_layers},num_kv_heads={shape.num_kv_heads},head_dim={shape.head_dim},"
        f"block_size={plan.block_size},dtype={plan.dtype},device={device},num_blocks={plan.num_blocks}"
    )


def format_plan(name: str, plan: CapacityPlan, *, device: str = "cuda") -> str:
    """The assumptions, then the arithmetic, then the `radixkv serve` line that serves it."""
    shape = plan.shape
    assumptions = [
        ("model", f"{name}: {shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim {shape.head_dim}"),
        ("dtype", f"{plan.dtype} ({DTYPE_BYTES[plan.dtype]} bytes per value; --dtype)"),
        ("block size", f"{plan.block_size} tokens (--block-size)"),
        ("device memory", f"{format_bytes(plan.device_memory_bytes)} (--gpu-memory)"),
        ("utilization", f"{plan.memory_utilization:g} of device memory for weights + KV (--utilization)"),
        ("weights", f"{format_bytes(plan.weight_bytes)} (--weights)"),
    ]
    figures = [
        ("KV bytes per token", f"{plan.bytes_per_token:,} ({plan.bytes_per_token / 1024:.0f} KiB)"),
        ("KV bytes per block", f"{plan.bytes_per_block:,} ({plan.bytes_per_block / MIB:.2f} MiB)"),
        ("KV budget", f"{format_bytes(plan.kv_budget_bytes)} = device memory x utilization - weights"),
        ("blocks", f"{plan.num_blocks:,}"),
        ("max tokens", f"{plan.max_tokens:,}"),
        (f"KV per sequence at {plan.context_len}", f"{plan.bytes_per_sequence / GIB:.3f} GiB"),
        (f"sequences at {plan.context_len}", f"{plan.max_sequences:,}"),
    ]
    width = max(len(k) for k, _ in assumptions + figures)
    lines = ["assumptions:"] + [f"  {k:<{width}}  {v}" for k, v in assumptions]
    lines += ["capacity:"] + [f"  {k:<{width}}  {v}" for k, v in figures]
    lines += ["serve it with:", f"  radixkv serve --pool {pool_flag(plan, device=device)}"]
    return "\n".join(lines)
