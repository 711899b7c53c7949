"""The host tier over the wire, against a real server: GetPool hands out its memory, open/append/step responses
carry the offloads and loads, Match and Stats count both tiers, and K/V written before an eviction comes back
bit for bit after a worker applies the pairs with `kernels.swap_blocks`.

One server process serves the module: each test has a tiered pool of its own (8 device blocks, 16 host blocks),
so what one test cached or evicted is not in another's pool."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.kernels import swap_blocks
from radixkv.sequences.step import Step
from radixkv.server.process.spawn import ServerProcess, patient
from radixkv.v1 import debug_pb2, debug_pb2_grpc

BS = 4
TIERED = "tiered:num_layers=2,num_kv_heads=2,head_dim=8,block_size=4,num_blocks=8,dtype=float32,host_num_blocks=16"
PLAIN = "plain:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8,dtype=float16"
# The tiered pools of the module's server, one per test that fills or evicts one.
TIERED_POOLS = ("get", "evict", "offloads", "metrics", "swap")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("host_tier") / "server.log"
    pools = [flag for name in TIERED_POOLS for flag in ("--pool", TIERED.replace("tiered:", f"{name}:", 1))]
    proc = ServerProcess([*pools, "--pool", PLAIN, "--debug-rpc", "--metrics-port", "0"], log)
    yield proc
    assert proc.stop() == 0, Path(log).read_text()[-2000:]


def check_invariants(address: str, pool: str) -> None:
    with grpc.insecure_channel(address) as channel:
        response = debug_pb2_grpc.DebugStub(channel).CheckInvariants(debug_pb2.CheckInvariantsRequest(pool=pool))
    assert not response.violation, response.violation


def write_kv(view: PoolView, table: list[int], num_tokens: int, seed: int) -> torch.Tensor:
    """What a worker writes for `num_tokens` tokens at the start of `table`; returns it per slot."""
    kv = torch.randn(view.layout.num_layers, 2, num_tokens, 2, 8, generator=torch.Generator().manual_seed(seed))
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(num_tokens)])
    flat = view.data.view(view.layout.num_layers, 2, -1, 2, 8)  # [layers, 2, num_blocks * block_size, H, D]
    flat[:, :, slots] = kv
    return kv


def read_kv(view: PoolView, table: list[int], num_tokens: int) -> torch.Tensor:
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(num_tokens)])
    return view.data.view(view.layout.num_layers, 2, -1, 2, 8)[:, :, slots].clone()


def apply(view: PoolView, offloads: np.ndarray, loads: np.ndarray) -> None:
    """The worker's order: offloads, then (no copies here) loads."""
    swap_blocks(view.data, view.host_data, offloads)
    swap_blocks(view.host_data, view.data, loads)


def test_get_pool_hands_out_the_host_tier(server) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address, pool="get") as client, PoolView.from_client(client) as view:
        info = view.info
        assert info.host is not None and info.host.layout.num_blocks == 16
        assert info.host.layout.block_size == info.layout.block_size == BS
        assert tuple(view.host_data.shape) == (2, 2, 16, BS, 2, 8)
        assert view.host_data.dtype == view.data.dtype
    with RadixKVClient(server.address, pool="plain") as client, PoolView.from_client(client) as view:
        assert view.info.host is None
        with pytest.raises(ValueError, match="host_data"):
            view.host_data  # noqa: B018


def test_kv_comes_back_identical_after_an_eviction_to_the_host_tier(server) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(1, 10))  # 2 full blocks and 1 token
    with RadixKVClient(server.address, pool="evict") as client, PoolView.from_client(client) as view:
        first = client.open(prompt)
        written = write_kv(view, first.block_table, len(prompt), seed=7)
        client.commit([first.seq_id], [len(prompt)])
        client.release(first.seq_id)
        others = []
        for i in range(2):  # 8 device blocks: the prompt's cached blocks are evicted to make room
            opened = client.open([100 + i] * 16)
            apply(view, opened.offloads, opened.loads)
            write_kv(view, opened.block_table, 16, seed=i)
            others.append(opened.seq_id)
        assert client.match_tiers(prompt) == (0, 8)
        client.release_many(others, cache=False)
        again = client.open(prompt)
        assert (again.num_cached_tokens, again.num_host_hit_tokens) == (8, 8)
        assert sorted(again.loads[:, 1].tolist()) == sorted(list(again.block_table[:2]))
        apply(view, again.offloads, again.loads)
        assert torch.equal(read_kv(view, again.block_table, 8), written[:, :, :8]), "the cached K/V, bit for bit"
        stats = client.stats()
        assert stats.num_host_hit_tokens == 8 and stats.num_loaded_blocks == 2 and stats.num_offloaded_blocks >= 2
        assert stats.num_host_blocks_total == 16
    check_invariants(server.address, "evict")


def test_append_and_step_responses_carry_offloads(server) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address, pool="offloads") as client:
        for t in (1, 2):
            opened = client.open([t] * 9)
            client.commit([opened.seq_id], [9])
            client.release(opened.seq_id)  # 2 cached blocks each: 4 of 8
        live = client.open([50] * 15)  # 4 blocks: every free one
        assert not len(live.offloads)
        batch = client.append_batch([live.seq_id], [2], [51, 52])  # a 5th block: evicts one cached block
        assert batch.offloads.shape == (1, 2)
        result = client.step(Step(opens=[([1] * 9, "default")]))  # [1]*9 lost its tail block to the host tier
        (opened,) = result.opened
        assert opened.num_host_hit_tokens == 4 and opened.num_cached_tokens == 8
        assert result.loads.shape == (1, 2) and result.loads[0, 1] == opened.block_table[1]
        assert len(result.offloads) >= 1, "the step's allocation evicted again"
    check_invariants(server.address, "offloads")


def test_match_and_metrics_count_the_host_tier(server) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address, pool="metrics") as client:
        opened = client.open([3] * 9)
        client.commit([opened.seq_id], [9])
        client.release(opened.seq_id)
        assert client.match_tiers([3] * 9) == (8, 0)
        hog = client.open([9] * 32)  # every device block
        assert client.match_tiers([3] * 9) == (0, 8) and client.match([3] * 9) == 0
        client.release(hog.seq_id, cache=False)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(10)) as r:
            text = r.read().decode()
    assert 'radixkv_host_blocks{pool="metrics",state="cached"} 2.0' in text
    assert 'radixkv_host_blocks{pool="metrics",state="free"} 14.0' in text
    assert 'radixkv_offloaded_blocks_total{pool="metrics"} 2.0' in text
    assert 'radixkv_host_blocks{pool="plain"' not in text, "no host tier, no host series"
    assert 'radixkv_swapped_sequences{pool="metrics"} 0.0' in text


def test_pool_keys_size_the_host_tier() -> None:
    from radixkv.server.rules.config import parse_pool_flag

    base = "p:num_layers=2,num_kv_heads=2,head_dim=8,block_size=4,num_blocks=8,dtype=float32"
    assert parse_pool_flag(base + ",host_num_blocks=32").host_num_blocks == 32
    assert parse_pool_flag(base + ",host_memory_bytes=65536").host_memory_bytes == 65536
    with pytest.raises(ValueError, match="at most one of host_num_blocks, host_memory_bytes"):
        parse_pool_flag(base + ",host_num_blocks=32,host_memory_bytes=65536")
    with pytest.raises(ValueError, match="host_num_blocks"):
        parse_pool_flag(base + ",host_num_blocks=-1")


def test_host_memory_bytes_sizes_by_the_layout() -> None:
    from radixkv.memory.layout import PoolLayout
    from radixkv.server.process.pool_setup import build_pool
    from radixkv.server.rules.config import parse_pool_flag

    config = parse_pool_flag("p:num_layers=2,num_kv_heads=2,head_dim=8,block_size=4,num_blocks=8,dtype=float32,"
                             "host_memory_bytes=10000")  # fmt: skip
    pool = build_pool(config, 16)
    try:
        per_block = PoolLayout(
            num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=1, dtype="float32"
        ).bytes_per_block
        assert pool.host_storage is not None and pool.host_storage.layout.num_blocks == 10000 // per_block
        assert pool.cache.stats().num_host_blocks_total == 10000 // per_block
        assert not pool.host_storage.is_pinned, "no CUDA pool: nothing to pin for"
    finally:
        pool.close()


def test_preempt_by_swap_and_resume_bring_the_kv_back(server) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(20, 34))  # 3 full blocks and 2 tokens
    with RadixKVClient(server.address, pool="swap") as client, PoolView.from_client(client) as view:
        seq = client.open(tokens)
        written = write_kv(view, seq.block_table, len(tokens), seed=3)
        client.commit([seq.seq_id], [len(tokens)])
        preempted = client.preempt([seq.seq_id], "swap")
        assert preempted.offloads.shape == (4, 2) and preempted.num_freed_blocks == 4
        swap_blocks(view.data, view.host_data, preempted.offloads)
        assert client.stats().num_swapped_sequences == 1
        hog = client.open([7] * 32)  # every device block: the old ones are overwritten
        write_kv(view, hog.block_table, 32, seed=4)
        client.release(hog.seq_id, cache=False)
        resumed = client.resume(seq.seq_id)
        assert (resumed.seq_id, resumed.num_cached_tokens, len(resumed.slots)) == (seq.seq_id, len(tokens), 0)
        apply(view, resumed.offloads, resumed.loads)
        assert torch.equal(read_kv(view, resumed.block_table, len(tokens)), written), "the swapped K/V, bit for bit"
        stats = client.stats()
        assert (stats.num_swapped_sequences, stats.num_host_blocks_swapped) == (0, 0)
    check_invariants(server.address, "swap")


def test_swap_needs_a_host_tier(server) -> None:  # type: ignore[no-untyped-def]
    from radixkv.errors import FailedPrecondition

    with RadixKVClient(server.address, pool="plain") as client:
        seq = client.open([1, 2, 3])
        with pytest.raises(FailedPrecondition):
            client.preempt([seq.seq_id], "swap")
    check_invariants(server.address, "plain")


# type: ignore[no-untyped-def]
def test_the_online_audit_passes_with_prefixes_on_the_host_tier(start_server, wait_until) -> None:
    import re

    server = start_server("--pool", TIERED, "--audit-interval", "0.02", "--metrics-port", "0", pool_flags=False)

    def value(name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(10)) as r:
            match = re.search(rf'^{name}{{pool="tiered"}} (\S+)$', r.read().decode(), re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    with RadixKVClient(server.address, pool="tiered") as client:
        for round_ in range(3):  # prefixes go to the host tier, come back, go again while the audit copies
            for t in range(4):
                opened = client.open([t] * 9 + [round_])
                client.commit([opened.seq_id], [10])
                client.release(opened.seq_id)
            runs = value("radixkv_audit_runs_total")
            assert wait_until(lambda runs=runs: value("radixkv_audit_runs_total") >= runs + 2)
        assert client.stats().num_offloaded_blocks > 0 and client.stats().num_host_hit_tokens > 0
    assert value("radixkv_audit_failures_total") == 0


def test_response_bounds_leave_room_for_transfers() -> None:
    """A request is refused up front when its response could outgrow the message: with a host tier, every block
    handed out may carry an offload and a load, so the bound grows by two transfers per block."""
    from radixkv.server.process.pool_setup import build_pool
    from radixkv.server.rules.checks import append_response_bytes, message_bytes_needed, open_response_bytes
    from radixkv.server.rules.config import parse_pool_flag

    shape = "num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=64,dtype=float32"
    plain, tiered = (build_pool(parse_pool_flag(f"p:{shape}{extra}"), 16) for extra in ("", ",host_num_blocks=64"))
    try:
        assert open_response_bytes(tiered, [9, 4]) - open_response_bytes(plain, [9, 4]) == 2 * 14 * (3 + 1)
        assert append_response_bytes(tiered, 2, 8) - append_response_bytes(plain, 2, 8) == 2 * 14 * (2 + 4)
        assert message_bytes_needed(1000, 10, host_tier=True) > message_bytes_needed(1000, 10) + 1000 * 28
    finally:
        plain.close()
        tiered.close()
