"""PoolLayout: the byte arithmetic of a pool, checked against numbers worked by hand, and its refusals."""

from __future__ import annotations

import pytest

from radixkv.memory.layout import PoolLayout, canonical_dtype

# Llama-3-8B-like: 32 layers, 8 KV heads of 128, fp16 -> 2 * 32 * 8 * 128 * 2 = 131,072 bytes per token.
LLAMA = PoolLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=1000, dtype="float16")


def test_bytes_per_token_block_and_pool() -> None:
    assert LLAMA.bytes_per_token == 131_072
    assert LLAMA.bytes_per_block == 16 * 131_072
    assert LLAMA.kv_bytes == LLAMA.total_bytes == 1000 * 16 * 131_072
    assert LLAMA.shape == (32, 2, 1000, 16, 8, 128)
    assert not LLAMA.is_scaled and LLAMA.scales_bytes == 0


def test_fp8_pool_carries_aligned_scales_after_the_blocks() -> None:
    layout = PoolLayout(num_layers=3, num_kv_heads=1, head_dim=5, block_size=1, num_blocks=1, dtype="float8_e4m3fn")
    assert layout.kv_bytes == 2 * 3 * 5  # 30 bytes of blocks
    assert layout.scales_offset == 32  # aligned up to 16
    assert layout.scales_bytes == 4 * 2 * 3  # fp32 (k_scale, v_scale) per layer
    assert layout.total_bytes == 32 + 24


def test_for_budget_takes_as_many_blocks_as_fit() -> None:
    budget = 10 * LLAMA.bytes_per_block + LLAMA.bytes_per_block - 1
    fitted = PoolLayout.for_budget(budget, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
    assert fitted.num_blocks == 10 and fitted.total_bytes <= budget
    fp8 = PoolLayout.for_budget(10_000, num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float8_e4m3fn")
    # fp8: the scales and their alignment come off the budget first, so at most one block more could fit.
    assert fp8.total_bytes <= 10_000 < fp8.total_bytes + 2 * fp8.bytes_per_block
    with pytest.raises(ValueError, match="holds no block"):
        PoolLayout.for_budget(100, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_blocks": 0}, "num_blocks"), ({"head_dim": True}, "head_dim"), ({"block_size": 12}, "power of two"),
     ({"dtype": "int8"}, "dtype"), ({"num_layers": 2.0}, "num_layers")],
)  # fmt: skip
def test_bad_fields_are_refused_by_name(change: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "num_blocks": 8}
    with pytest.raises(ValueError, match=message):
        PoolLayout(**(fields | change))  # type: ignore[arg-type]


def test_dtype_aliases() -> None:
    assert canonical_dtype("fp8") == "float8_e4m3fn" and canonical_dtype("bf16") == "bfloat16"
    assert canonical_dtype("float32") == "float32"
