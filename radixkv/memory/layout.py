"""The shape of a pool's KV memory, and its size in bytes, without touching any tensor."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from radixkv.memory.block_pool import cdiv

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
# Dtypes stored as value / scale: the pool carries fp32 (k_scale, v_scale) per layer after the blocks.
SCALED_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
_SCALES_ALIGN = 16


def canonical_dtype(name: str) -> str:
    """The dtype's full (torch) name: "fp8" -> "float8_e4m3fn"; names already full pass through."""
    return DTYPE_ALIASES.get(name, name)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolLayout:
    """One pool: `num_blocks` blocks of `block_size` tokens, K and V for every layer.

    The memory is one allocation shaped
    `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; slot = block_id * block_size + offset.
    An fp8 pool follows it (at `scales_offset`) with fp32 `[num_layers, 2]` scales, each layer's K and V
    stored as value / scale, so every process mapping the pool reads the same scales.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str = "float16"

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks")

    def __post_init__(self) -> None:
        for name in self.SHAPE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def kv_bytes(self) -> int:
        """The blocks' bytes, K and V of every layer."""
        return self.bytes_per_block * self.num_blocks

    @property
    def is_scaled(self) -> bool:
        return self.dtype in SCALED_DTYPES

    @property
    def scales_offset(self) -> int:
        """Where the fp32 scales start: after the blocks, aligned to 16 bytes."""
        return cdiv(self.kv_bytes, _SCALES_ALIGN) * _SCALES_ALIGN

    @property
    def scales_bytes(self) -> int:
        return 4 * 2 * self.num_layers if self.is_scaled else 0

    @property
    def total_bytes(self) -> int:
        """The whole allocation: the blocks, then (fp8 only) the aligned scales."""
        return self.scales_offset + self.scales_bytes if self.is_scaled else self.kv_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: str = "float16",
    ) -> PoolLayout:
        """The layout with as many blocks as fit in `budget_bytes`."""
        probe = cls(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            num_blocks=1,
            dtype=dtype,
        )
        num_blocks = (budget_bytes - probe.scales_bytes - _SCALES_ALIGN * probe.is_scaled) // probe.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no block of {probe.bytes_per_block} bytes")
        return dataclasses.replace(probe, num_blocks=num_blocks)
