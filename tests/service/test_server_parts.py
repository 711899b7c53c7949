"""The server's parts in-process (milliseconds): configuration, tenant scoping, event numbering and gaps."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.errors import PermissionDenied
from radixkv.kv_cache import KVCache, Limits
from radixkv.server.events.hub import EventHub, EventKind
from radixkv.server.process.app import parse_args
from radixkv.server.rules.config import ServerConfig, TenantConfig, config_from_mapping, parse_pool_flag
from radixkv.server.rules.tenants import ANONYMOUS, Tenant


def test_pool_flags_parse_layout_size_and_limits() -> None:
    pool = parse_pool_flag(
        "big:num_layers=32,num_kv_heads=8,head_dim=128,block_size=32,dtype=bfloat16,memory_fraction=0.5,max_fork_children=4"
    )
    assert (pool.name, pool.num_layers, pool.block_size, pool.dtype, pool.memory_fraction) == (
        "big",
        32,
        32,
        "bfloat16",
        0.5,
    )
    assert pool.limits == Limits(max_fork_children=4)
    for bad in (
        "nocolon",
        "p:num_layers=1,num_kv_heads=1,head_dim=1",
        "p:num_layers=1,num_kv_heads=1,head_dim=1,num_blocks=4,memory_bytes=9",
        "p:num_layers=1,typo=3,num_blocks=1",
    ):
        with pytest.raises((ValueError, TypeError)):
            parse_pool_flag(bad)


def test_toml_config_and_flags_combine(tmp_path: Path) -> None:
    config_file = tmp_path / "radixkv.toml"
    config_file.write_text(
        "session_ttl_seconds = 12.5\nmax_message_bytes = 1024\n"
        "[pools.default]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 8\nnum_blocks = 64\n"
        "[pools.other]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 4\nmemory_bytes = 65536\n"
    )
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.acme]\ntoken = "t"\nnamespaces = ["chat"]\nmax_blocks = 3\nmap_pools = true\n')
    config, level = parse_args(
        [
            "serve",
            "--config",
            str(config_file),
            "--pool",
            "default:num_layers=4,num_kv_heads=2,head_dim=8,num_blocks=8",
            "--port",
            "7000",
            "--auth-tokens",
            str(tokens),
            "--log-level",
            "debug",
        ]
    )
    assert (
        level == "debug"
        and config.port == 7000
        and config.session_ttl_seconds == 12.5
        and config.max_message_bytes == 1024
    )
    assert [(p.name, p.num_layers) for p in config.pools] == [
        ("other", 1),
        ("default", 4),
    ]  # the flag replaced the file's default
    assert config.tenants == (TenantConfig(name="acme", token="t", namespaces=("chat",), max_blocks=3, map_pools=True),)
    with pytest.raises(ValueError, match="unknown top-level keys"):
        config_from_mapping(
            {
                "sesion_ttl_seconds": 1,
                "pools": {"p": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "num_blocks": 1}},
            }
        )
    with pytest.raises(ValueError, match="at least one pool"):
        ServerConfig(pools=())
    with pytest.raises(ValueError, match="tenant"):
        TenantConfig(name="bad/name", token="t")


def test_tenants_scope_namespaces_so_names_never_collide() -> None:
    acme = Tenant.from_config(TenantConfig(name="acme", token="t", namespaces=("chat", "code"), max_blocks=8))
    assert acme.scope("chat") == "acme/chat" and acme.unscope("acme/chat") == "chat"
    assert acme.owns("acme/code") and not acme.owns("globex/chat")
    with pytest.raises(PermissionDenied):
        acme.scope("")  # "default" is not among acme's namespaces
    anyone = Tenant.from_config(TenantConfig(name="globex", token="u"))
    assert anyone.scope("") == "globex/default"
    assert ANONYMOUS.scope("") == "default" and ANONYMOUS.scope("x") == "x" and ANONYMOUS.owns("anything")


def cache_written(cache: KVCache, token_ids: list[int], namespace: str) -> None:
    """Open, write every token's K/V (commit) and release cached: the prefix is now in the tree."""
    seq_id = cache.open(token_ids, namespace).seq_id
    cache.commit([seq_id], [len(token_ids)])
    cache.release(seq_id)


def test_events_are_numbered_per_namespace_and_a_slow_watcher_sees_the_gap() -> None:
    cache = KVCache(num_blocks=8, block_size=2)
    hub = EventHub(cache, max_events_per_watcher=2)
    slow = hub.watch(lambda ns: ns == "a")
    for i in range(4):  # four 1-block prompts: four stored events in "a"
        cache_written(cache, [10 * i, 10 * i + 1, 5], "a")
    cache_written(cache, [90, 91, 5], "b")  # not watched
    assert [e.sequence_number for e in slow.take(0)[0]] == [1, 2]  # 3 and 4 were dropped: the queue held 2
    cache_written(cache, list(range(100, 112)), "a")  # 6 blocks: evicts the LRU cached ones
    later, _ = slow.take(0)
    assert [e.sequence_number for e in later] == [5, 6]  # the jump from 2 to 5 tells the watcher to resync
    assert [e.kind for e in later] == [EventKind.BLOCKS_REMOVED, EventKind.BLOCKS_STORED]
    snapshot = hub.snapshot(lambda ns: ns == "a")
    assert {e.sequence_number for e in snapshot} == {6}
    assert sorted(b for e in snapshot for b in e.block_ids) == sorted(
        b for ns, node in cache.tree.nodes() if ns == "a" for b in node.block_ids
    )
    hub.unwatch(slow)
    assert slow.closed and hub.num_watchers == 0
    cache.check_invariants()
