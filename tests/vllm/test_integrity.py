"""The connector's load check against a writer who bypasses the rules, on a real server's pool, mapped as the worker
maps it: a block tampered in memory after its saver vouched for it is a load error (vLLM recomputes it) and none of
its bytes reach vLLM's KV tensors; the untouched blocks load exactly.

One tampering is a crafted collision against the linear checksum of earlier releases (a position-weighted sum of
the block's 32-bit words with public weights): two K/V values negated, chosen so that sum does not change. The old
check passed it (asserted here); the BLAKE3 digest the server keeps does not. No vLLM is needed: the worker side is
torch and the pool; SmolLM2-135M's block shape (30 layers, 3 KV heads, head_dim 64, 32 tokens) gives the old sum
enough words for a two-word collision.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.server.process.spawn import ServerProcess
from radixkv.vllm.layouts import CpuLayout
from radixkv.vllm.plan import StepPlan
from radixkv.vllm.worker_side import WorkerSide

LAYERS, HEADS, BLOCK, DIM = 30, 3, 32, 64
POOL = f"default:num_layers={LAYERS},num_kv_heads={HEADS},head_dim={DIM},block_size={BLOCK},num_blocks=12,dtype=float32"


def old_linear_checksum(block: torch.Tensor) -> int:
    """The check of earlier releases, as it was: odd 64-bit weights from a public seed, over the int32 words."""
    words = block.contiguous().view(torch.int32).reshape(-1).to(torch.int64)
    seeded = torch.Generator().manual_seed(0x5AD1C5)
    weights = torch.randint(-(2**62), 2**62, (len(words),), generator=seeded, dtype=torch.int64) | 1
    return int((words * weights).sum() | 1) & 0xFFFFFFFFFFFFFFFF


def forge_against_linear(block: torch.Tensor) -> tuple[int, int]:
    """Two word positions whose sign bits, both flipped, leave the old sum unchanged (mod 2^64).

    Flipping word x's sign bit adds s * 2^31 (s = +1 if x < 0, else -1), so the sum moves by 2^31 (s_i w_i + s_j w_j):
    zero when s_i w_i = -s_j w_j mod 2^33. Among 368,640 words ~8 such pairs exist; sorting finds one.
    """
    words = block.contiguous().view(torch.int32).reshape(-1).numpy()
    seeded = torch.Generator().manual_seed(0x5AD1C5)
    weights = (torch.randint(-(2**62), 2**62, (len(words),), generator=seeded, dtype=torch.int64) | 1).numpy()
    mask = np.uint64((1 << 33) - 1)
    signed = np.where(words < 0, weights, -weights).view(np.uint64) & mask
    wanted = (np.uint64(1 << 33) - signed) & mask
    order = np.argsort(signed)
    at = np.clip(np.searchsorted(signed[order], wanted), 0, len(order) - 1)
    hits = np.flatnonzero(signed[order[at]] == wanted)
    assert len(hits), "no two-word collision in this block (the data would need other words)"
    return int(order[at[hits[0]]]), int(hits[0])


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[RadixKVClient, PoolView]]:
    with ServerProcess(["--pool", POOL]) as server, RadixKVClient(server.address) as client:
        with PoolView(client.get_pool()) as view:
            yield client, view


def engine(seed: int) -> list[torch.Tensor]:
    """One vLLM engine's KV tensors, CPU layout [B, H, N, 2D] per layer, random (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(10, HEADS, BLOCK, 2 * DIM, generator=gen) for _ in range(LAYERS)]


@pytest.mark.parametrize("group_blocks", [None, 1], ids=["one-group", "a-group-per-block"])
def test_a_block_tampered_in_memory_is_refused_at_load(
    pool: tuple[RadixKVClient, PoolView], group_blocks: int | None
) -> None:
    """Also with a group per block: saves and loads pipelined through the reused staging buffers, the refused blocks
    in the middle. vLLM's blocks start random: a refused block is wiped, neither tampered nor stale bytes stay."""
    client, view = pool
    first = 1000 if group_blocks is None else 5000  # a prompt of each case's own
    prompt = list(range(first, first + 4 * BLOCK + 1))
    saver_kv = engine(seed=1)
    saver = WorkerSide(PoolView(client.get_pool()), saver_kv, CpuLayout)  # each engine maps the pool
    if group_blocks is not None:
        saver.group_blocks = group_blocks
    opened = client.open(prompt)
    saves = StepPlan()
    for i in range(4):
        saves.saves.add("r", i, 2 + i, opened.block_table[i])  # vLLM blocks 2..5 -> the sequence's blocks
    digests = saver.save(saves)["r"]
    client.commit([opened.seq_id], [4 * BLOCK])
    client.cache(opened.seq_id)
    assert client.checksums.record(opened.seq_id, 0, [digests[i] for i in range(4)]) == 4
    client.release(opened.seq_id)

    again = client.open(prompt)
    assert again.num_cached_tokens == 4 * BLOCK
    table, vouched = again.block_table[:4], client.checksums.get(again.seq_id, 0, 4)
    # Block 1: a crafted collision against the old linear checksum. Block 2: one value's smallest change.
    block1 = view.data[:, :, table[1]]
    before = old_linear_checksum(block1)
    flat = block1.view(torch.int32)
    for position in forge_against_linear(block1.clone()):
        index = np.unravel_index(position, tuple(block1.shape))
        flat[index] = flat[index] ^ torch.tensor(-(2**31), dtype=torch.int32)  # the sign bit: a value negated
    assert old_linear_checksum(view.data[:, :, table[1]]) == before  # the old check would have served it
    value = view.data[7, 1, table[2], 5, 1, 33]
    view.data[7, 1, table[2], 5, 1, 33] = torch.nextafter(value, torch.tensor(float("inf")))

    loader_kv = engine(seed=2)
    loader = WorkerSide(PoolView(client.get_pool()), loader_kv, CpuLayout)
    if group_blocks is not None:
        loader.group_blocks = group_blocks
    loads = StepPlan()
    for i in range(4):
        loads.loads.add("r2", i, table[i], 6 + i, vouched[i])  # -> vLLM blocks 6..9
    loader.load(loads)
    assert loader.take_load_errors() == {7, 8} and loader.failed_reqs == {"r2"}  # vLLM recomputes them
    for layer in range(LAYERS):
        assert torch.equal(loader_kv[layer][6], saver_kv[layer][2]) and torch.equal(
            loader_kv[layer][9], saver_kv[layer][5]
        )
        assert not loader_kv[layer][7:9].any()  # wiped: not a byte of the tampered blocks is served
    client.release(again.seq_id, cache=False)
    saver.close()
    loader.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="one CPU")
def test_digests_run_beside_a_thread_pinned_to_one_core(pool: tuple[RadixKVClient, PoolView]) -> None:
    """vLLM's CPU worker pins its thread to one core; the hashing threads it starts must not inherit that."""
    client, _ = pool
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        worker = WorkerSide(PoolView(client.get_pool()), engine(seed=3), CpuLayout)
        hashing = worker._hashers.submit(os.sched_getaffinity, 0).result()
    finally:
        os.sched_setaffinity(0, allowed)
    worker.close()
    assert hashing == allowed
