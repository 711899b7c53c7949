"""`radixkv.client.Router` against real server processes: routing by cached prefix, gaps, restarts and kills."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from radixkv.client import RadixKVClient, Router

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

_spec = importlib.util.spec_from_file_location("fleet_conftest", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
fleet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fleet)
BLOCK_SIZE, wait_until = fleet.BLOCK_SIZE, fleet.wait_until

HEALTH_INTERVAL = 0.5


def _cache_on(address: str, tokens: list[int], namespace: str = "") -> None:
    with RadixKVClient(address) as client:
        _release_written(client, [client.open(tokens, namespace).seq_id])


def test_routes_to_the_instance_holding_the_prefix_and_hashes_match_the_server(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    servers = [start_fleet_server() for _ in range(3)]
    prompt = list(range(1, 6 * BLOCK_SIZE + 2))
    with Router([s.address for s in servers], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL, seed=0) as router:
        assert router.wait_ready()
        _cache_on(servers[1].address, prompt)
        _cache_on(servers[2].address, prompt[: 2 * BLOCK_SIZE])
        assert wait_until(lambda: router.num_cached_blocks(servers[1].address, prompt) == 6)
        assert wait_until(lambda: router.num_cached_blocks(servers[2].address, prompt) == 2)
        assert router.route(prompt) == servers[1].address  # cost 0 uncached + 0 load, against 6 and 4
        # Dynamo's cost counts the load routed there: 7 blocks per route soon outweigh 6 uncached ones.
        assert servers[1].address != router.route(prompt)
        # The same tokens in another namespace share no hash: nothing is cached for them anywhere.
        assert all(router.num_cached_blocks(s.address, prompt, "chat") == 0 for s in servers)
        with RadixKVClient(servers[1].address) as client, client.watch_events(include_snapshot=True) as stream:
            snapshot = next(stream.batches())
        assert {h for e in snapshot.events for h in e.block_hashes} == set(router.chain(prompt)[:6])
        assert all(t > 0 for t in router.decision_seconds())


def test_a_gap_resyncs_from_a_snapshot(start_fleet_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "small_queue.toml"
    config.write_text("watch_queue_size = 2\n")  # a watcher that falls 3 events behind misses some
    server = start_fleet_server(num_blocks=256, extra=("--config", str(config)))
    prompts = [[i] * (2 * BLOCK_SIZE + 1) for i in range(1, 21)]
    with Router([server.address], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router:
        assert router.wait_ready()
        with RadixKVClient(server.address) as client:
            seq_ids = [r.seq_id for r in client.open_many([(p, "") for p in prompts])]
            _release_written(client, seq_ids)  # 20 events under one lock hold: the watcher's queue overflows
            _release_written(client, [client.open([99] * (BLOCK_SIZE + 1)).seq_id])  # the next event shows the jump
        assert wait_until(lambda: router.status()[0].num_resyncs >= 1)
        assert wait_until(lambda: all(router.num_cached_blocks(server.address, p) == 2 for p in prompts))
        assert router.num_cached_blocks(server.address, [99] * (BLOCK_SIZE + 1)) == 1


def test_a_restart_is_a_new_epoch_and_a_fresh_index(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server = start_fleet_server()
    old_prompt, new_prompt = [5] * (3 * BLOCK_SIZE + 1), [6] * (3 * BLOCK_SIZE + 1)
    with Router([server.address], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router:
        assert router.wait_ready()
        _cache_on(server.address, old_prompt)
        assert wait_until(lambda: router.num_cached_blocks(server.address, old_prompt) == 3)
        first_epoch = router.status()[0].epoch
        server.kill()
        server.start()  # same port, a new incarnation, an empty cache
        assert wait_until(lambda: router.status()[0].num_rebuilds == 1 and router.status()[0].healthy, timeout=60)
        assert router.wait_ready()
        status = router.status()[0]
        assert status.epoch not in (0, first_epoch)
        assert router.num_cached_blocks(server.address, old_prompt) == 0, "nothing survives into the new index"
        _cache_on(server.address, new_prompt)
        assert wait_until(lambda: router.num_cached_blocks(server.address, new_prompt) == 3)


def test_a_killed_instance_leaves_within_a_health_interval_and_returns_after_restart(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    servers = [start_fleet_server() for _ in range(3)]
    victim = servers[0]
    prompt = list(range(100, 100 + 4 * BLOCK_SIZE + 1))
    with Router([s.address for s in servers], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router:
        assert router.wait_ready()
        _cache_on(victim.address, prompt)
        assert wait_until(lambda: router.route(prompt) == victim.address)
        victim.kill()  # how soon it leaves is measured by bench_fleet, not asserted here
        assert wait_until(lambda: not router.status()[0].healthy, timeout=60)
        routed = {router.route(prompt) for _ in range(50)}
        assert victim.address not in routed, "no request routed to an instance that failed its health check"
        victim.start()
        assert wait_until(lambda: router.status()[0].healthy and router.status()[0].epoch != 0, timeout=60)
        assert router.num_cached_blocks(victim.address, prompt) == 0, "it comes back with a fresh index"
        _cache_on(victim.address, prompt)
        assert wait_until(lambda: router.route(prompt) == victim.address)


def test_with_auth_the_router_hashes_the_tenants_scoped_namespaces(start_fleet_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.acme]\ntoken = "acme-token"\nnamespaces = ["chat"]\n')
    server = start_fleet_server(extra=("--auth-tokens", str(tokens), "--kv-events-insecure-publish-tenant-prompts"))
    prompt = list(range(40, 40 + 3 * BLOCK_SIZE + 1))
    with RadixKVClient(server.address, token="acme-token") as client:
        _release_written(client, [client.open(prompt, "chat").seq_id])
    with Router([server.address], block_size=BLOCK_SIZE, token="acme-token", tenant="acme") as router:
        assert router.wait_ready()
        assert wait_until(lambda: router.num_cached_blocks(server.address, prompt, "chat") == 3)
    with Router([server.address], block_size=BLOCK_SIZE, token="acme-token") as unscoped:
        assert unscoped.wait_ready()
        assert unscoped.num_cached_blocks(server.address, prompt, "chat") == 0, "another tenant's salt: no hit"


def test_with_no_instance_reachable_route_says_so() -> None:
    from radixkv.client import NoInstanceAvailable

    with Router(["127.0.0.1:1"], block_size=BLOCK_SIZE, health_interval=HEALTH_INTERVAL) as router:
        assert not router.wait_ready(timeout=1.0)
        with pytest.raises(NoInstanceAvailable, match="none of the 1 instances"):
            router.route([1, 2, 3, 4, 5])
        assert router.status()[0].healthy is False


def _release_written(client: RadixKVClient, seq_ids: list[int]) -> None:
    """Release as a worker that wrote every token would: commit them all, then release cached."""
    client.commit(seq_ids, [n for n, _ in client.describe_sequences(seq_ids)])
    client.release_many(seq_ids)
