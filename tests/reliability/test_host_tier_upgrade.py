"""The host tier across a restart, with real processes: a keeper holding both tiers' memory, servers coming and going.

- a prefix evicted to the host tier before a graceful stop (SIGTERM) is still there after it: the new server
  adopts the snapshot, an open loads it back, and once the worker applies the loads (`kernels.swap_blocks`)
  the K/V bytes are those written before the restart;
- a host block changed while no server runs: the snapshot is refused (HOST_KV_CHECKSUM), the pool starts cold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.server.process.spawn import KeeperProcess, ServerProcess, patient
from tests.reliability.conftest import Debug
from tests.reliability.test_upgrade import _once_reachable
from tests.service.test_host_tier import apply, read_kv, write_kv

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

TIERED = "default:num_layers=2,num_kv_heads=2,head_dim=8,block_size=4,num_blocks=8,dtype=float32,host_num_blocks=16"
PROMPT = list(range(1, 10))  # 2 full blocks of 4 tokens and 1 token


@pytest.fixture
def keeper(tmp_path: Path):
    k = KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log")
    yield k
    k.stop()


def _serve(keeper: KeeperProcess, log_path: Path, *extra: str) -> ServerProcess:
    return ServerProcess(["--pool", TIERED, "--keeper", str(keeper.socket), "--debug-rpc", *extra], log_path)


def _log_lines(path: Path, message: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("msg") == message]


def _evict_prompt_to_the_host_tier(client: RadixKVClient, view: PoolView) -> tuple[torch.Tensor, list[int]]:
    """Cache PROMPT with K/V written, then push it to the host tier; returns that K/V and its host blocks."""
    first = client.open(PROMPT)
    written = write_kv(view, first.block_table, len(PROMPT), seed=7)
    client.commit([first.seq_id], [len(PROMPT)])
    client.release(first.seq_id)
    prompt_blocks = set(first.block_table[:2].tolist())
    host_blocks: list[int] = []
    others = []
    for i in range(2):  # 8 device blocks: the prompt's cached blocks are evicted to make room
        opened = client.open([100 + i] * 16)
        apply(view, opened.offloads, opened.loads)
        host_blocks += [int(h) for d, h in opened.offloads.tolist() if d in prompt_blocks]
        write_kv(view, opened.block_table, 16, seed=i)
        others.append(opened.seq_id)
    client.release_many(others, cache=False)
    assert client.match_tiers(PROMPT) == (0, 8) and len(host_blocks) == 2
    return written, host_blocks


# type: ignore[no-untyped-def]
def test_a_prefix_on_the_host_tier_loads_back_with_the_same_kv_after_a_restart(keeper, tmp_path) -> None:
    first = _serve(keeper, tmp_path / "server1.log")
    client = RadixKVClient(first.address, session_ttl=60, timeout=patient(60))
    with PoolView.from_client(client) as view:
        written, _ = _evict_prompt_to_the_host_tier(client, view)
    assert first.stop() == 0  # SIGTERM: a graceful stop writes the snapshot
    second = _serve(keeper, tmp_path / "server2.log", "--port", str(first.port))
    try:
        assert _once_reachable(lambda: client.match_tiers(PROMPT)) == (0, 8), "the host tier came back"
        (adopted,) = _log_lines(tmp_path / "server2.log", "snapshot adopted")
        assert adopted["pool"] == "default"
        with PoolView.from_client(client) as view:
            again = client.open(PROMPT)
            assert (again.num_cached_tokens, again.num_host_hit_tokens) == (8, 8)
            assert sorted(again.loads[:, 1].tolist()) == sorted(again.block_table[:2].tolist())
            apply(view, again.offloads, again.loads)
            assert torch.equal(read_kv(view, again.block_table, 8), written[:, :, :8]), "K/V bytes of before"
        assert client.stats().num_host_hit_tokens == 8
        client.release(again.seq_id)
        Debug(second.address).check()
    finally:
        client.close()
        second.stop()


# type: ignore[no-untyped-def]
def test_a_changed_host_byte_is_refused_and_the_pool_starts_cold(keeper, tmp_path) -> None:
    first = _serve(keeper, tmp_path / "server1.log")
    with RadixKVClient(first.address, timeout=patient(60)) as client, PoolView.from_client(client) as view:
        _, host_blocks = _evict_prompt_to_the_host_tier(client, view)
        assert first.stop() == 0
        view.host_data[0, 0, host_blocks[0], 0, 0, 0] += 1.0  # the keeper's memory, mapped still: one K value
    second = _serve(keeper, tmp_path / "server2.log")
    try:
        (refused,) = _log_lines(tmp_path / "server2.log", "snapshot refused: starting cold")
        assert refused["why"] == "HOST_KV_CHECKSUM"
        with RadixKVClient(second.address, timeout=patient(60)) as client:
            assert client.match_tiers(PROMPT) == (0, 0), "nothing adopted"
            assert client.stats().num_host_blocks_free == 16
        Debug(second.address).check()
    finally:
        second.stop()


# type: ignore[no-untyped-def]
def test_a_sequence_swapped_out_before_a_restart_resumes_after_it_with_its_kv(keeper, tmp_path) -> None:
    tokens = list(range(50, 61))  # 11 tokens: 3 blocks, none cached in the tree while it lives
    first = _serve(keeper, tmp_path / "server1.log")
    client = RadixKVClient(first.address, session_ttl=60, timeout=patient(60))
    with PoolView.from_client(client) as view:
        opened = client.open(tokens)
        written = write_kv(view, opened.block_table, len(tokens), seed=11)
        client.commit([opened.seq_id], [len(tokens)])
        swapped = client.preempt([opened.seq_id], "swap")
        assert len(swapped.offloads) == 3
        apply(view, swapped.offloads, swapped.offloads[:0])
    assert first.stop() == 0
    second = _serve(keeper, tmp_path / "server2.log", "--port", str(first.port))
    try:
        assert _once_reachable(lambda: client.stats()).num_swapped_sequences == 1
        with PoolView.from_client(client) as view:
            resumed = client.resume(opened.seq_id)
            assert resumed.seq_id == opened.seq_id and resumed.num_cached_tokens == len(tokens)
            assert len(resumed.loads) == 3
            apply(view, resumed.offloads, resumed.loads)
            assert torch.equal(read_kv(view, resumed.block_table, len(tokens)), written), "the swapped K/V, bit for bit"
        client.release(opened.seq_id)
        Debug(second.address).check()
    finally:
        client.close()
        second.stop()
