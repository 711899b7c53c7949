"""A pool's `eviction_policy` key: parsed, checked, and the built pool's core evicts by it."""

from __future__ import annotations

import pytest

from radixkv.server.process.pool_setup import build_pool
from radixkv.server.rules.config import parse_pool_flag, pool_keys_help
from radixkv.tree.eviction import AgentPolicy, EvictionPolicy

LAYOUT = "num_layers=1,num_kv_heads=1,head_dim=4,num_blocks=64"


def test_the_pool_key_picks_the_core_policy_and_lru_stays_the_default() -> None:
    agent, plain = parse_pool_flag(f"a:{LAYOUT},eviction_policy=agent"), parse_pool_flag(f"b:{LAYOUT}")
    assert (agent.eviction_policy, plain.eviction_policy) == ("agent", "lru")
    pools = [build_pool(p, 16, None) for p in (agent, plain)]
    try:
        assert type(pools[0].cache.tree.policy) is AgentPolicy
        assert type(pools[1].cache.tree.policy) is EvictionPolicy
    finally:
        for pool in pools:
            pool.close()
    assert "eviction_policy" in pool_keys_help()


def test_an_unknown_policy_is_refused_naming_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"eviction_policy must be one of agent, lru, slru, tlru, got 'fifo'"):
        parse_pool_flag(f"a:{LAYOUT},eviction_policy=fifo")
