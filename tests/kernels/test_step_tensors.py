"""step_tensors / host_to_device: a step's numpy arrays on the device in one staged copy, and the kernels fed from
host arrays (the path callers use) without a host sync."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from radixkv.kernels import (
    copy_blocks,
    host_to_device,
    paged_decode_attention,
    plan_decode,
    step_tensors,
    store_kv,
    swap_blocks,
)

gpu = pytest.mark.gpu
BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 64, 24


@dataclasses.dataclass
class HostArrays:
    """A step as the hand-off delivers it (`radixkv.sequences.handoff.StepArrays`'s fields): numpy, on the host."""

    seq_ids: np.ndarray
    query_starts: np.ndarray
    slots: np.ndarray
    copies: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray


def decode_step(seq_lens: list[int], copies: list[tuple[int, int]]) -> HostArrays:
    """One new token per sequence; sequence i owns blocks 4i..4i+3; `copies` between spare blocks."""
    tables = np.array([[4 * i + j for j in range(4)] for i in range(len(seq_lens))], dtype=np.int32)
    last = np.array(seq_lens) - 1
    return HostArrays(
        seq_ids=np.arange(10, 10 + len(seq_lens), dtype=np.int64),
        query_starts=np.arange(len(seq_lens) + 1, dtype=np.int32),
        slots=(tables[np.arange(len(seq_lens)), last // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + last % BLOCK_SIZE),
        copies=np.array(copies, dtype=np.int64).reshape(-1, 2),
        block_tables=tables,
        seq_lens=np.array(seq_lens, dtype=np.int32),
    )


def test_on_cpu_the_tensors_are_the_arrays():
    arrays = decode_step([3, 9, 16], [(20, 21)])
    t = step_tensors(arrays, "cpu")
    for f in dataclasses.fields(HostArrays):
        array, tensor = getattr(arrays, f.name), getattr(t, f.name)
        assert tensor.numpy().dtype == array.dtype and tensor.shape == array.shape, f.name
        assert np.shares_memory(tensor.numpy(), array), f"{f.name}: copied, not shared"


def test_to_another_device_a_step_is_one_copy():
    """Six arrays, one host-to-device copy of one packed buffer (meta stands for a device here: no memory, but the
    same path as CUDA's); each tensor keeps its array's dtype and shape, 16-byte aligned in the buffer."""
    arrays = decode_step([3, 9, 16], [(20, 21), (22, 23)])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = step_tensors(arrays, "meta")
    copies = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy"]
    aligned = sum(-(-getattr(arrays, f.name).nbytes // 16) * 16 for f in dataclasses.fields(HostArrays))
    assert copies == [[aligned]], "one copy of the packed bytes"
    for f in dataclasses.fields(HostArrays):
        tensor, array = getattr(t, f.name), getattr(arrays, f.name)
        assert tensor.device.type == "meta" and tensor.shape == array.shape, f.name
        assert tensor.dtype == torch.from_numpy(array).dtype, f.name


def test_host_to_device_keeps_values_and_handles_empty_and_strided_arrays():
    strided = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    arrays = [np.empty((0, 2), np.int64), strided, np.array([2**40], dtype=np.int64)]
    out = host_to_device(arrays, "cpu")
    assert [a.tolist() for a in out] == [a.tolist() for a in arrays]
    assert host_to_device([], "meta") == []


@pytest.mark.parametrize("pairs", [np.array([[20, 21]], dtype=np.int64), [(20, 21)], [(20, 21, 0)]])
def test_copy_blocks_checks_host_pairs_where_they_are(pairs):
    """Host pairs are read on the host (no device cost), so they are checked by default on any device."""
    pool = torch.zeros(1, 2, 22, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="^pairs: block id 21 is out of range"):
        copy_blocks(pool[:, :, :21], pairs)
    copy_blocks(pool, pairs)


# ---------------------------------------------------------------------------------------- CUDA: no host sync


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_a_step_from_host_arrays_never_syncs(kv_dtype):
    """A decode step fed the way a worker feeds it, numpy from the hand-off: step_tensors, copy-on-write from numpy
    pairs, an offload from a list, store, plan from host lengths, attend, under torch's sync debug mode set to
    raise. Every host-to-device copy is a pinned DMA (a pageable one blocks the host, and the mode misses it)."""
    lens = [9, 16, 3]
    arrays = decode_step(lens, [(20, 21)])
    pool = torch.randn(1, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(kv_dtype)
    host = torch.zeros(1, 2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=kv_dtype).pin_memory()
    scales = torch.tensor([0.5, 0.25], device="cuda") if kv_dtype == torch.float8_e4m3fn else None
    key = torch.randn(len(lens), NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    q = torch.randn(len(lens), 8, HEAD_DIM, device="cuda", dtype=torch.float16)

    def step() -> torch.Tensor:
        t = step_tensors(arrays, "cuda")
        swap_blocks(pool, host, [(22, 1)]).wait()
        copy_blocks(pool, arrays.copies)
        copy_blocks(pool, [(22, 23)])
        store_kv(key, key, pool[0], t.slots, kv_scales=scales)
        plan = plan_decode(lens, num_q_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, cache_dtype=kv_dtype, device="cuda")
        return paged_decode_attention(q, pool[0], t.block_tables, t.seq_lens, 0.125, kv_scales=scales, plan=plan)

    step()  # compiles the kernels outside the checked region
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    memcpys = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert memcpys and all("Pinned" in name for name in memcpys), memcpys
    expected = paged_decode_attention(q, pool[0], torch.from_numpy(arrays.block_tables).cuda(),
                                      torch.from_numpy(arrays.seq_lens).cuda(), 0.125, kv_scales=scales)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
