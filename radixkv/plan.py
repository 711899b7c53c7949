"""Capacity arithmetic a serving team runs before deploying: how much KV fits, in blocks and sequences."""

from __future__ import annotations

import dataclasses

from radixkv.layout import DTYPE_BYTES, canonical_dtype

GIB = 2**30
MIB = 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


# KV-relevant shapes of well-known models (weights are deployment-specific: pass them).
MODEL_SHAPES: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(32, 32, 128),
    "llama-2-70b": ModelShape(80, 8, 128),
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(80, 8, 128),
    "mistral-7b": ModelShape(32, 8, 128),
    "qwen2-7b": ModelShape(28, 4, 128),
}


@dataclasses.dataclass(frozen=True, slots=True)
class CapacityPlan:
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
        raise ValueError(f"no memory left for KV: {device_memory_bytes} x {memory_utilization} - {weight_bytes} weights")
    num_blocks = budget // bytes_per_block
    blocks_per_sequence = -(-context_len // block_size)
    return CapacityPlan(
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
    """'80GiB', '16 GB', '512MiB', '1e9' -> bytes (GB/GiB both mean 2^30 here, as GPU specs do)."""
    units = {"tib": 2**40, "tb": 2**40, "gib": GIB, "gb": GIB, "mib": MIB, "mb": MIB, "kib": 1024, "kb": 1024, "b": 1}
    cleaned = text.strip().lower().replace(" ", "")
    for unit, factor in units.items():
        if cleaned.endswith(unit):
            return int(float(cleaned[: -len(unit)]) * factor)
    return int(float(cleaned))


def format_plan(name: str, plan: CapacityPlan) -> str:
    rows = [
        ("model", name),
        ("KV bytes per token", f"{plan.bytes_per_token:,} ({plan.bytes_per_token / 1024:.0f} KiB)"),
        ("KV bytes per block", f"{plan.bytes_per_block:,} ({plan.bytes_per_block / MIB:.2f} MiB)"),
        ("KV budget", f"{plan.kv_budget_bytes / GIB:.2f} GiB"),
        ("blocks", f"{plan.num_blocks:,}"),
        ("max tokens", f"{plan.max_tokens:,}"),
        (f"KV per sequence at {plan.context_len}", f"{plan.bytes_per_sequence / GIB:.3f} GiB"),
        (f"sequences at {plan.context_len}", f"{plan.max_sequences:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
