import pytest

from radixkv.memory.layout import PoolLayout
from radixkv.planning.plan import GIB, MIB, MODEL_SHAPES, parse_bytes, plan_capacity


@pytest.mark.parametrize(
    ("model", "context", "gib_per_sequence"),
    [("llama-2-70b", 4096, 1.25), ("llama-3-8b", 4096, 0.50)],
)
def test_kv_per_sequence(model, context, gib_per_sequence):
    plan = plan_capacity(MODEL_SHAPES[model], device_memory_bytes=80 * GIB, context_len=context)
    assert plan.bytes_per_sequence == gib_per_sequence * GIB


def test_llama3_8b_on_one_80gib_gpu():
    plan = plan_capacity(
        MODEL_SHAPES["llama-3-8b"],
        device_memory_bytes=80 * GIB,
        memory_utilization=0.90,
        weight_bytes=16 * GIB,
        block_size=16,
        context_len=4096,
    )
    assert plan.kv_budget_bytes == 56 * GIB
    assert plan.bytes_per_block == 2 * MIB
    assert plan.num_blocks == 28_672
    assert plan.max_tokens == 458_752
    assert plan.max_sequences == 112


def test_llama3_70b_on_four_80gib_gpus():
    plan = plan_capacity(
        MODEL_SHAPES["llama-3-70b"],
        device_memory_bytes=320 * GIB,
        memory_utilization=0.90,
        weight_bytes=140 * GIB,
        block_size=16,
        context_len=2048,
    )
    assert plan.kv_budget_bytes == 148 * GIB
    assert plan.bytes_per_block == 5 * MIB
    assert plan.num_blocks == 30_310
    assert plan.max_tokens == 484_960
    assert plan.max_sequences == 236


def test_plan_agrees_with_pool_layout():
    shape = MODEL_SHAPES["llama-3-8b"]
    plan = plan_capacity(shape, device_memory_bytes=80 * GIB, weight_bytes=16 * GIB)
    layout = PoolLayout.for_budget(
        plan.kv_budget_bytes,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=16,
    )
    assert layout.num_blocks == plan.num_blocks
    assert layout.bytes_per_token == plan.bytes_per_token


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_utilization": 1.5}, "memory_utilization"),
        ({"weight_bytes": 100 * GIB}, "no memory left"),
        ({"dtype": "int3"}, "dtype"),
    ],
)
def test_plan_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_capacity(MODEL_SHAPES["llama-3-8b"], device_memory_bytes=80 * GIB, **kwargs)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80GiB", 80 * GIB),
        ("16 GB", 16 * 10**9),
        ("16 GiB", 16 * GIB),
        ("512MiB", 512 * MIB),
        ("1000B", 1000),
        ("0", 0),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("field", ["num_layers", "block_size", "num_blocks"])
def test_layout_rejects_non_positive(field):
    kwargs = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "num_blocks": 8}
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        PoolLayout(**kwargs)


def test_layout_rejects_block_size_not_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        PoolLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=24, num_blocks=8)


def test_fp8_doubles_the_capacity_of_fp16():
    fp16 = plan_capacity(MODEL_SHAPES["llama-3-8b"], device_memory_bytes=80 * GIB, weight_bytes=16 * GIB)
    fp8 = plan_capacity(MODEL_SHAPES["llama-3-8b"], device_memory_bytes=80 * GIB, weight_bytes=16 * GIB, dtype="fp8")
    assert fp8.bytes_per_token * 2 == fp16.bytes_per_token
    assert fp8.num_blocks == 2 * fp16.num_blocks and fp8.max_sequences == 2 * fp16.max_sequences
