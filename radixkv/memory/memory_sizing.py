"""Sizing a pool to memory: how many blocks fit a byte budget or a fraction of a device's free memory."""

from __future__ import annotations

import os

import torch

from radixkv.memory.layout import PoolLayout
from radixkv.memory.shm_segment import SHM_DIR, shm_free_bytes


def layout_for_memory(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    device: str | torch.device,
    budget_bytes: int | None = None,
    memory_fraction: float | None = None,
    reserved_bytes: int = 0,
) -> PoolLayout:
    """The layout with as many blocks as fit a byte budget, or a fraction of `device`'s free memory.

    Either `budget_bytes`, or `memory_fraction` of `free_memory_bytes(device)` (as vLLM's
    `--gpu-memory-utilization`); `reserved_bytes` (weights, activations) comes off either.

    Raises:
        ValueError: both or neither budget given, a value out of range, or a budget holding no block.
    """
    if (budget_bytes is None) == (memory_fraction is None):
        raise ValueError("budget_bytes, memory_fraction: give exactly one")
    if not isinstance(reserved_bytes, int) or isinstance(reserved_bytes, bool) or reserved_bytes < 0:
        raise ValueError(f"reserved_bytes: expected an int >= 0, got {reserved_bytes!r}")
    if budget_bytes is not None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes: expected a positive int, got {budget_bytes!r}")
        budget = budget_bytes
    else:
        if (
            isinstance(memory_fraction, bool)
            or not isinstance(memory_fraction, (int, float))
            or not 0 < memory_fraction <= 1
        ):
            raise ValueError(f"memory_fraction: expected 0 < fraction <= 1, got {memory_fraction!r}")
        budget = int(free_memory_bytes(device) * memory_fraction)
    if budget - reserved_bytes <= 0:
        raise ValueError(f"reserved_bytes: {reserved_bytes} reserved leaves nothing of a {budget}-byte budget")
    return PoolLayout.for_budget(
        budget - reserved_bytes,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )


def free_memory_bytes(device: str | torch.device) -> int:
    """Free memory a pool could take: CUDA's free bytes, or on CPU available RAM capped by /dev/shm's free space."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    if device.type != "cpu":
        raise ValueError(f"device: expected cpu or cuda, got {device}")
    available = _mem_available_bytes()
    return min(available, shm_free_bytes()) if os.path.isdir(SHM_DIR) else available


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
