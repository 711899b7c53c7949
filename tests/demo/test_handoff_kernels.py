"""The worker hand-off, end to end: what the core returns goes to the kernels in one call, and they compute the right
thing. Here, not under tests/kernels: it needs the core (`KVCache`, `StepArrays`), which the kernels never import.

A small pool walks through prefill, fork and a decode step with copy-on-write; after each step the
worker applies `step_tensors(...)` with the real kernels, and attention through the paged tables must
equal attention over each sequence's dense K/V history.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from radixkv import KVCache
from radixkv.kernels import copy_blocks, paged_decode_attention, step_tensors, store_kv
from radixkv.sequences.handoff import StepArrays

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 32, 4, 2, 16


@pytest.fixture
def device() -> str:
    """CUDA when there is one, else CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [num_q_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_dim]
    weights = torch.softmax(torch.einsum("hd,thd->ht", q, k) * scale, dim=-1)  # [num_q_heads, seq_len]
    return torch.einsum("ht,thd->hd", weights, v)


class Worker:
    """Applies steps to one layer's K/V and remembers each sequence's dense history to check against."""

    def __init__(self, device: str) -> None:
        self.device = device
        # kv_data: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_data = torch.zeros(1, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device)
        self.dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)

    def write(self, arrays: StepArrays) -> None:
        t = step_tensors(arrays, self.device)
        copy_blocks(self.kv_data, t.copies)
        k = torch.randn(len(arrays.slots), NUM_KV_HEADS, HEAD_DIM, generator=self.gen).to(self.device)
        v = torch.randn(len(arrays.slots), NUM_KV_HEADS, HEAD_DIM, generator=self.gen).to(self.device)
        store_kv(k, v, self.kv_data[0], t.slots)
        starts = arrays.query_starts
        for i, seq_id in enumerate(arrays.seq_ids.tolist()):
            old_k, old_v = self.dense.get(seq_id, (k[:0], v[:0]))
            self.dense[seq_id] = (
                torch.cat([old_k, k[starts[i] : starts[i + 1]]]),
                torch.cat([old_v, v[starts[i] : starts[i + 1]]]),
            )
            assert len(self.dense[seq_id][0]) == arrays.seq_lens[i], "seq_lens must count every token written"

    def check_attention(self, arrays: StepArrays) -> None:
        t = step_tensors(arrays, self.device)
        q = torch.randn(len(arrays.seq_ids), 4, HEAD_DIM, generator=self.gen).to(self.device)
        out = paged_decode_attention(q, self.kv_data[0], t.block_tables, t.seq_lens, HEAD_DIM**-0.5)
        for i, seq_id in enumerate(arrays.seq_ids.tolist()):
            k, v = self.dense[seq_id]
            torch.testing.assert_close(out[i], _dense_attention(q[i], k, v, HEAD_DIM**-0.5), atol=2e-5, rtol=1e-4)


def test_prefill_fork_and_cow_decode_through_the_kernels(device):
    cache, worker = KVCache(NUM_BLOCKS, BLOCK_SIZE), Worker(device)
    opened = cache.open_many([(list(range(6)), "default"), (list(range(100, 109)), "default")])
    prefill = StepArrays.from_opens(opened)
    worker.write(prefill)
    worker.check_attention(prefill)

    parent, other = opened[0].seq_id, opened[1].seq_id
    children = cache.fork(parent, 2)  # all three share the partial block 1 (tokens 4, 5)
    for child in children:
        worker.dense[child] = worker.dense[parent]
    batch = cache.append_batch([parent, *children, other], [1, 1, 1, 2], [6, 7, 8, 109, 110])
    assert len(batch.copies) == 2, "two of the three holders of the shared partial block copy it"
    step = batch.step_arrays(cache.block_table)
    assert step.copies.tolist() == [[src, dst] for src, dst, _ in batch.copies]
    worker.write(step)
    worker.check_attention(step)


def test_step_tensors_have_the_kernels_dtypes_after_pickling():
    """The arrays themselves are tests/core/test_handoff.py's; here, what a worker process receives."""
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    a, b = cache.open_many([(list(range(9)), "default"), (list(range(50, 53)), "default")])
    decode = cache.append_batch([b.seq_id], [2], [53, 54]).step_arrays(cache.block_table)
    both = StepArrays.concat([StepArrays.from_opens([a, b]), decode])
    t = step_tensors(pickle.loads(pickle.dumps(both)), "cpu")
    assert (t.slots.dtype, t.copies.dtype, t.block_tables.dtype, t.seq_lens.dtype, t.seq_ids.dtype) == (
        torch.int64, torch.int64, torch.int32, torch.int32, torch.int64,
    )  # fmt: skip
    assert t.block_tables.tolist() == both.block_tables.tolist()
    assert t.slots.tolist() == both.slots.tolist() and t.seq_lens.tolist() == both.seq_lens.tolist()


def test_copy_blocks_takes_what_the_core_returns(device):
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    parent = cache.open(list(range(6))).seq_id
    child = cache.fork(parent, 1)[0]
    batch = cache.append_batch([parent, child], [1, 1], [6, 7])
    ((src, dst, _),) = batch.copies
    kv_data = torch.randn(2, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device)
    for pairs in (batch.copies, batch.results()[0].copies, batch.copy_pairs()):
        kv_data[:, :, dst] = 0
        copy_blocks(kv_data, pairs)
        assert torch.equal(kv_data[:, :, dst], kv_data[:, :, src]), f"applied from {type(pairs).__name__}"


@pytest.mark.parametrize(
    "pairs,message",
    [(np.array([[1.0, 2.0]]), "pairs: expected an int64 array"), ([(1,)], "pairs: expected an int64 tensor")],
)
def test_copy_blocks_names_a_malformed_conversion(pairs, message):
    with pytest.raises(ValueError, match=message):
        copy_blocks(torch.zeros(1, 2, 4, 4, 1, 8), pairs)
