"""Eviction policies and retention hints in the core: each order holds, hints are soft, and they survive a snapshot."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.errors import InvalidArgument, OutOfBlocks
from radixkv.kv_cache import KVCache
from radixkv.memory.layout import PoolLayout
from radixkv.state.snapshot import PoolIdentity, dump, load
from radixkv.tree.eviction import POLICIES, KeyedPolicy, Retention, make_policy
from radixkv.tree.radix_tree import RadixTree

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(policy: str = "lru", num_blocks: int = 16) -> tuple[KVCache, Clock]:
    clock = Clock()
    return KVCache(num_blocks, BS, tree=RadixTree(BS, policy=make_policy(policy, BS, clock))), clock


def cache_prompt(cache: KVCache, tokens: list[int], namespace: str = "default") -> None:
    opened = cache.open(tokens + [0], namespace)
    cache.commit([opened.seq_id], [len(tokens) + 1])
    cache.release(opened.seq_id)
    cache.check_invariants()


def prompt(first: int, num_blocks: int) -> list[int]:
    return list(range(first, first + num_blocks * BS))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_the_invariants_under_random_traffic(policy: str):
    cache, clock = make(policy, 24)
    rng = random.Random(policy)
    contexts = [prompt(1000 * i, 2) for i in range(6)]
    for step in range(300):
        clock.now += rng.choice([1, 5, 60])
        i = rng.randrange(len(contexts))
        if rng.random() < 0.15:
            contexts[i] = contexts[i][: BS * rng.randint(1, max(1, len(contexts[i]) // BS))]  # a branch
        contexts[i] = contexts[i] + list(range(100_000 + step * 10, 100_000 + step * 10 + rng.randint(1, 9)))
        contexts[i] = contexts[i][: 8 * BS]
        try:
            cache_prompt(cache, contexts[i][: len(contexts[i]) // BS * BS])
        except OutOfBlocks:
            pass
        if rng.random() < 0.1:
            cache.retain(contexts[rng.randrange(6)], retention=Retention(ttl_s=rng.choice([0, 30]), priority=1))
        if rng.random() < 0.05:
            cache.retain(contexts[rng.randrange(6)], retention=Retention(end_session=True))
        cache.check_invariants()


def test_a_ttl_keeps_a_prefix_ahead_of_lru_but_never_refuses_an_admission():
    cache, clock = make("lru", 8)
    kept, other = prompt(100, 2), prompt(200, 2)
    cache_prompt(cache, kept)
    clock.now += 1
    cache_prompt(cache, other)
    assert cache.retain(kept, retention=Retention(ttl_s=300)) == 2 * BS
    cache_prompt(cache, prompt(300, 5))  # 6 blocks with the partial one: 2 evicted, the unhinted ones
    assert cache.match(kept) == 2 * BS and cache.match(other) == 0
    cache_prompt(cache, prompt(400, 7))  # the whole pool: the TTL gives way rather than refuse
    assert cache.match(kept) == 0


def test_an_expired_ttl_and_its_priority_decay_to_the_default():
    cache, clock = make("lru", 8)
    old, new = prompt(100, 2), prompt(200, 2)
    cache_prompt(cache, old)
    cache.retain(old, retention=Retention(ttl_s=60, priority=9))
    clock.now += 10
    cache_prompt(cache, new)
    clock.now += 100  # old's TTL ran out: it is plain LRU again, and older than new
    cache_prompt(cache, prompt(300, 5))  # 6 blocks, 4 free
    assert cache.match(old) == 0 and cache.match(new) == 2 * BS
    leaf = cache.tree.evictable_leaves()
    assert all(n.retain_priority == 0 for n in leaf)


def test_a_ttl_refreshes_on_use_unless_asked_not_to_and_expire_drops_what_ran_out():
    cache, clock = make("lru", 16)
    refreshed, fixed = prompt(100, 2), prompt(200, 2)
    for tokens, refresh in ((refreshed, True), (fixed, False)):
        cache_prompt(cache, tokens)
        cache.retain(tokens, retention=Retention(ttl_s=60, refresh=refresh))
    clock.now += 50
    cache_prompt(cache, refreshed)
    cache_prompt(cache, fixed)
    clock.now += 20  # 70 s after the hint, 20 s after the last use
    assert cache.expire() == 2
    assert cache.match(refreshed) == 2 * BS and cache.match(fixed) == 0
    cache.check_invariants()


def test_end_of_session_drops_its_own_branch_first_not_the_shared_prefix():
    cache, clock = make("lru", 12)
    system = prompt(1, 1)
    done, live = system + prompt(100, 2), system + prompt(200, 2)
    cache_prompt(cache, done)
    clock.now += 1
    cache_prompt(cache, live)
    assert cache.retain(done, retention=Retention(end_session=True)) == 3 * BS
    cache_prompt(cache, prompt(900, 8))  # needs 2 of the 5 cached blocks back: the ended branch's
    assert cache.match(live) == 3 * BS and cache.match(done) == BS  # the shared system prompt stays


def test_a_bad_hint_is_refused_naming_the_field():
    with pytest.raises(InvalidArgument) as e:
        Retention(ttl_s=-1)
    assert e.value.field == "retention.ttl_s"
    with pytest.raises(InvalidArgument) as e:
        Retention(priority=10**9)
    assert e.value.field == "retention.priority"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo", BS)


def test_an_oracle_key_orders_eviction():
    """A keyed policy (MIN in `radixkv replay`): the leaf with the lowest key goes first."""
    rank = {100: 0, 200: 2, 300: 1}
    clock = Clock()
    policy = KeyedPolicy("min", lambda n: (rank.get(int.from_bytes(n.token_bytes[:4], "little"), 9), n.node_id), clock)
    cache = KVCache(8, BS, tree=RadixTree(BS, policy=policy))
    for first in (100, 200, 300):
        cache_prompt(cache, prompt(first, 2))
    cache_prompt(cache, prompt(900, 3))  # 4 blocks, 2 free: the lowest key (100) goes
    assert [cache.match(prompt(f, 2)) for f in (100, 200, 300)] == [0, 2 * BS, 2 * BS]


def test_hints_survive_a_snapshot_and_an_older_snapshot_restores_unhinted():
    cache, _ = make("lru", 16)
    kept = prompt(100, 2)
    cache_prompt(cache, kept)
    cache.retain(kept, retention=Retention(ttl_s=600, priority=3))
    identity = PoolIdentity(
        pool="default",
        layout=PoolLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BS, num_blocks=16),
        memory_id="mem-1",
    )
    restored = load(dump(cache, identity), identity).cache
    nodes = [n for _, n in restored.tree.nodes()]
    assert nodes and all(n.retain_priority == 3 and n.retain_ttl_s == 600 for n in nodes)
    assert all(590 < n.retain_until_s - restored.tree.policy.clock() <= 600 for n in nodes)
    import radixkv.state.cache_state as cs

    original = cs.capture_retention
    cs.capture_retention = lambda nodes, now: None  # as a snapshot from before hints
    try:
        old = load(dump(cache, identity), identity).cache
    finally:
        cs.capture_retention = original
    assert all(n.retain_priority == 0 and not n.retain_until_s for _, n in old.tree.nodes())
    assert old.match(kept) == 2 * BS
    np.testing.assert_array_equal(old.tree.tree_block_ids(), restored.tree.tree_block_ids())


def test_the_agent_policy_drops_a_superseded_branch_before_an_older_live_one():
    """A session rewrote its context (a new request left its old branch part-way): the old tail goes first, ahead
    of another session's older context, which LRU would take."""
    for policy, superseded_first in (("agent", True), ("lru", False)):
        cache, clock = make(policy, 12)
        other, mine = prompt(500, 4), prompt(100, 4)
        cache_prompt(cache, other)
        clock.now += 10
        cache_prompt(cache, mine)
        clock.now += 10
        rewritten = mine[: 2 * BS] + prompt(700, 2)  # compacted: the same first two blocks, then new ones
        cache_prompt(cache, rewritten)
        cache_prompt(cache, prompt(900, 3))  # 4 blocks with the partial one, 2 free: 2 evicted
        if superseded_first:
            assert cache.match(other) == 4 * BS and cache.match(mine) == 2 * BS
        else:
            assert cache.match(other) == 2 * BS and cache.match(mine) == 4 * BS
        assert cache.match(rewritten) == 4 * BS


def test_the_agent_policy_never_calls_other_sessions_on_a_shared_prompt_superseded():
    """Three sessions below one system prompt: the second looks like the first one's rewrite, but the third shows
    a shared prefix, so nothing below it stays superseded."""
    cache, clock = make("agent", 24)
    system = prompt(1, 1)
    sessions = [system + prompt(100 * (i + 1), 3) for i in range(3)]
    policy = cache.tree.policy
    for i, tokens in enumerate(sessions):
        cache_prompt(cache, tokens)
        clock.now += 1
        assert len(policy._superseded) == (1 if i == 1 else 0)  # noqa: SLF001 (the list this test is about)
    assert sorted(len(leaf.token_bytes) for leaf in cache.tree.evictable_leaves()) == [3 * BS * 4] * 3


def test_a_branch_pause_is_a_moving_mean_that_one_long_break_moves_only_part_way():
    cache, clock = make("agent", 32)
    tokens = prompt(100, 2)
    for pause in (10.0, 10.0, 10.0, 1000.0):
        clock.now += pause
        cache_prompt(cache, tokens)
    (leaf,) = cache.tree.evictable_leaves()
    assert 10.0 < leaf.gap_s < 200.0  # 10 s typical, then one break of 1000 s: the geometric mean, ~100 s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    steps=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(1, 3), st.sampled_from([0.5, 5.0, 60.0, 900.0])),
        min_size=1,
        max_size=60,
    ),
)
def test_agent_traffic_keeps_every_policy_evicting_leaves_only(policy: str, steps: list[tuple[int, int, int, float]]):
    """Sessions that grow, pause and rewrite (keep k blocks of the old context, add new ones): after every request
    the tree passes its check (a node is cached only below a cached parent, so no parent went before its child),
    and each evicted block was a leaf's tail at the time (the policy lists only leaves)."""
    cache, clock = make(policy, 20)
    removed_while_parent_of_cached: list[int] = []

    class Watch:
        def blocks_stored(self, node: object) -> None:
            pass

        def blocks_removed(self, namespace: str, block_ids: np.ndarray) -> None:
            cached = {int(b) for _, n in cache.tree.nodes() for b in n.block_ids}
            removed_while_parent_of_cached.extend(int(b) for b in block_ids if int(b) in cached)

    cache.tree.observer = Watch()
    contexts = [prompt(10_000 * (i + 1), 1) for i in range(5)]
    for step, (session, keep, grow, pause) in enumerate(steps):
        clock.now += pause
        old = contexts[session]
        kept = old[: BS * min(keep, len(old) // BS)] if keep else old  # keep 0: plain growth
        contexts[session] = (kept + prompt(1_000_000 + 100 * step, grow))[: 6 * BS]
        try:
            cache_prompt(cache, contexts[session])
        except OutOfBlocks:
            pass
    cache.check_invariants()
    assert not removed_while_parent_of_cached


def test_a_snapshot_restores_under_the_pool_policy():
    cache = KVCache(16, BS, eviction_policy="agent")
    cache_prompt(cache, prompt(100, 2))
    identity = PoolIdentity(
        pool="default",
        layout=PoolLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BS, num_blocks=16),
        memory_id="mem-1",
    )
    restored = load(dump(cache, identity), identity, eviction_policy="agent").cache
    assert restored.tree.policy.name == "agent" and restored.match(prompt(100, 2)) == 2 * BS
    restored.check_invariants()
    assert load(dump(cache, identity), identity).cache.tree.policy.name == "lru"


def test_tlru_budgets_are_in_model_tokens_when_a_token_id_stands_for_many():
    policy = make_policy("tlru", 8, tokens_per_id=64)
    assert (policy.xi, policy.q_hat) == (16384 // 64, 2048 // 64)
