"""Item 2 and 3 of the fleet's trust: a hash contract checked at connect, and an index that proves itself.

Real server processes: instances with another block size are refused by name (never a silent miss);
after random workloads with evictions the router's digest equals the server's `Verify` digest; an
event dropped on purpose inside the router's index is caught by the digest, counted, and repaired.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import grpc
import pytest

from radixkv.client import HashContractMismatch, RadixKVClient, Router
from radixkv.errors import OutOfBlocks
from radixkv.server.process.spawn import patient
from radixkv.tree.block_hash import HashContract
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

_spec = importlib.util.spec_from_file_location("fleet_conftest", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
fleet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fleet)
BLOCK_SIZE, wait_until = fleet.BLOCK_SIZE, fleet.wait_until

HEALTH_INTERVAL = 0.5


def _release_written(client: RadixKVClient, seq_ids: list[int]) -> None:
    client.commit(seq_ids, [n for n, _ in client.describe_sequences(seq_ids)])
    client.release_many(seq_ids)


def test_get_pool_states_the_contract_and_mixed_block_sizes_are_refused_by_name(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    same, other = start_fleet_server(), start_fleet_server(block_size=2 * BLOCK_SIZE)
    with grpc.insecure_channel(other.address) as channel:
        contract = kvcache_pb2_grpc.KVCacheStub(channel).GetPool(pb.GetPoolRequest(pool="default")).hash_contract
    assert (contract.algorithm, contract.root_seed, contract.block_size) == (
        "sha256_cbor",
        "vllm-none-hash",
        2 * BLOCK_SIZE,
    )
    assert (contract.salt_rule, contract.wire_form, contract.format_version) == (
        "vllm-tagged-cache-salt-in-first-block-extra-keys", "low64", 2,
    )  # fmt: skip
    # The client: a matching contract connects, another block size is refused at construction.
    with RadixKVClient(same.address, block_size=BLOCK_SIZE) as client:
        assert client.verify().hash_contract == HashContract(block_size=BLOCK_SIZE)
    with pytest.raises(HashContractMismatch) as refused:
        RadixKVClient(other.address, block_size=BLOCK_SIZE)
    assert refused.value.endpoint == other.address
    assert refused.value.differences == {"block_size": (BLOCK_SIZE, 2 * BLOCK_SIZE)}
    assert "block_size" in str(refused.value) and other.address in str(refused.value)
    # The router: one mismatched instance and it refuses to route at all, naming it.
    prompt = list(range(1, 4 * BLOCK_SIZE + 2))
    with Router([same.address, other.address], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router:
        with pytest.raises(HashContractMismatch, match="block_size") as mixed:
            router.wait_ready(timeout=patient(60))
        assert mixed.value.endpoint == other.address
        with pytest.raises(HashContractMismatch):
            router.route(prompt)
        assert router.status()[1].epoch == 0 and router.status()[1].num_indexed_blocks == 0, "never indexed"
    with Router([same.address], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router:
        assert router.wait_ready()
        assert router.route(prompt) == same.address


def _random_workload(client: RadixKVClient, rng: random.Random, num_steps: int) -> None:
    """Prompts sharing prefixes in two namespaces, written in full, released cached; a small pool evicts."""
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    live: list[int] = []
    for _ in range(num_steps):
        if rng.random() < 0.6 or not live:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 25)] + [
                rng.randrange(1, 50) for _ in range(rng.randrange(6))
            ]
            try:
                live.append(client.open(tokens or [7], rng.choice(["", "chat"])).seq_id)
            except OutOfBlocks:
                continue
        else:
            _release_written(client, [live.pop(rng.randrange(len(live)))])
    if live:
        _release_written(client, live)


def _in_step(router: Router, client: RadixKVClient, address: str) -> bool:
    status = router.status()[0]
    return status.digest == client.verify().digest and router.index(address).digests == client.verify().digests


def test_router_and_server_digests_agree_after_random_workloads_with_evictions(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server = start_fleet_server(num_blocks=24)  # small: the workload evicts
    with (
        Router([server.address], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router,
        RadixKVClient(server.address, block_size=BLOCK_SIZE) as client,
    ):
        assert router.wait_ready()
        for seed in range(3):
            _random_workload(client, random.Random(seed), 80)
            assert wait_until(lambda: _in_step(router, client, server.address)), (router.status(), client.verify())
        assert client.stats().num_evicted_blocks > 0, "the workload must evict"
        result = client.verify()
        assert set(result.digests) == {"default", "chat"} and result.digest != 0
        assert sum(result.num_blocks.values()) == client.stats().num_blocks_cached
        assert router.status()[0].num_divergences == 0


def test_a_dropped_event_is_detected_by_the_digest_and_repaired_by_a_resync(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server = start_fleet_server(num_blocks=64)
    first, second = [3] * (2 * BLOCK_SIZE + 1), [4] * (3 * BLOCK_SIZE + 1)
    with (
        Router([server.address], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router,
        RadixKVClient(server.address) as client,
    ):
        assert router.wait_ready()
        _release_written(client, [client.open(first).seq_id])
        assert wait_until(lambda: router.num_cached_blocks(server.address, first) == 2)
        router.index(server.address).num_events_to_drop = 1  # the next event is lost inside the index
        _release_written(client, [client.open(second).seq_id])
        assert wait_until(lambda: router.status()[0].num_divergences == 1)
        status = router.status()[0]
        assert status.num_resyncs == 0, "no gap in the numbers: only the digest could tell"
        # Repaired from a snapshot: the lost blocks are back and the digests agree again.
        assert wait_until(lambda: router.num_cached_blocks(server.address, second) == 3)
        assert wait_until(lambda: _in_step(router, client, server.address))
        assert router.num_cached_blocks(server.address, first) == 2
        assert router.status()[0].num_divergences == 1
