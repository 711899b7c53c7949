"""A pool without a host tier has one of no blocks (`HostTier.enabled` False, as vLLM's null block): every history
behaves as before the tier was always there. Nothing is offloaded, loaded or listed on the host; eviction trims
leaves in place (the tree's own `DropEvicted`, never a split); swap is refused with FailedPrecondition and changes
nothing; snapshots record no host tier (`"host": None`, the format a pool without one always wrote) and restore."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from radixkv import KVCache, PoolLayout
from radixkv.errors import FailedPrecondition, RadixKVError, SnapshotRefused
from radixkv.state.cache_state import capture, rebuild
from radixkv.state.snapshot import PoolIdentity, dump, load
from radixkv.tree.radix_tree import DropEvicted
from tests.core.test_snapshot import fingerprint
from tests.examples import examples

BLOCK_SIZE = 2
NUM_BLOCKS = 16
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 51, 52, 53], [7, 7, 7, 7, 7, 7]]
HOST_STATS = (
    "num_host_blocks_total",
    "num_host_blocks_free",
    "num_host_blocks_cached",
    "num_host_blocks_swapped",
    "num_swapped_sequences",
    "num_offloaded_blocks",
    "num_loaded_blocks",
    "num_host_evicted_blocks",
    "num_host_hit_tokens",
    "num_preemptions_swap",
)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(0, 2), st.integers(1, 10), st.lists(st.integers(0, 60), max_size=4)),
        st.tuples(st.just("append"), st.integers(0, 7), st.lists(st.integers(0, 60), min_size=1, max_size=5)),
        st.tuples(st.just("commit"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(1, 5)),
        st.tuples(st.just("recompute"), st.integers(0, 7)),
        st.tuples(st.just("swap"), st.integers(0, 7)),
        st.tuples(st.just("resume"), st.integers(0, 7)),
        st.tuples(st.just("release"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("restore")),
    ),
    max_size=30,
)


def null_tier_holds(cache: KVCache) -> None:
    """The tier of none took nothing: no host block anywhere, the tree drops what it evicts, host stats all 0."""
    assert not cache.host.enabled and cache.host.pool.num_blocks == 0
    assert isinstance(cache.tree.host, DropEvicted)
    for root in cache.tree.roots.values():
        assert not root.host_children
    for _, node in cache.tree.nodes():
        assert not len(node.host_block_ids) and not node.host_children
    stats = cache.stats()
    assert {name: getattr(stats, name) for name in HOST_STATS} == dict.fromkeys(HOST_STATS, 0)
    assert not len(cache.host.take_offloads())
    cache.check_invariants()


def no_transfers(result: object) -> None:
    for field in ("offloads", "loads"):
        assert not len(getattr(result, field, ())), field
    assert getattr(result, "num_host_hit_tokens", 0) == 0


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=ops)
def test_a_pool_without_a_host_tier_behaves_as_one_with_none(history: list[tuple]) -> None:
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    live: list[int] = []  # live and preempted sequences, by position
    for op, *args in history:
        seq = live[args[0] % len(live)] if live and op not in ("open", "evict", "restore") else None
        try:
            if op == "open":
                base, cut, tail = args
                opened = cache.open(BASES[base][:cut] + tail)
                no_transfers(opened)
                live.append(opened.seq_id)
            elif op == "append" and seq is not None and not cache.is_preempted(seq):
                no_transfers(cache.append_batch([seq], [len(args[1])], args[1]))
            elif op == "commit" and seq is not None and not cache.is_preempted(seq):
                cache.commit([seq], [cache.num_tokens(seq)])
            elif op == "evict":
                ids = {n.node_id for _, n in cache.tree.nodes()}
                cache.evict(args[0])
                assert {n.node_id for _, n in cache.tree.nodes()} <= ids, "eviction split a leaf (a host tier's way)"
            elif op == "recompute" and seq is not None and not cache.is_preempted(seq):
                no_transfers(cache.preempt([seq], "recompute"))
            elif op == "swap" and seq is not None:
                before = fingerprint(cache)
                with pytest.raises(RadixKVError) as refused:
                    cache.preempt([seq], "swap")
                if not cache.is_preempted(seq):  # a preempted one is refused as such first
                    assert isinstance(refused.value, FailedPrecondition)
                    assert refused.value.metadata["field"] == "mode"
                    assert "needs a host tier" in str(refused.value)
                assert fingerprint(cache) == before
            elif op == "resume" and seq is not None and cache.is_preempted(seq):
                no_transfers(cache.resume(seq))
            elif op == "release" and seq is not None:
                cache.release(seq, cache=args[1])
                live.remove(seq)
            elif op == "restore":
                state = capture(cache)
                assert state["host"] is None  # what a pool without a host tier always wrote
                restored = rebuild(state)
                assert fingerprint(restored) == fingerprint(cache)
                cache = restored
        except RadixKVError:
            pass  # a refusal (no room, a budget): what matters is that it changed nothing the checks can see
        null_tier_holds(cache)


def test_a_partial_eviction_trims_the_leaf_in_place() -> None:
    """Without a host tier a leaf holding more than the need keeps its node (and its place), its tail dropped."""
    cache = KVCache(8, BLOCK_SIZE)
    seq = cache.open(list(range(12))).seq_id
    cache.commit([seq], [12])
    cache.release(seq)
    [(_, leaf)] = list(cache.tree.nodes())
    assert cache.evict(2) == 2
    [(_, after)] = list(cache.tree.nodes())
    assert after is leaf and len(after.block_ids) == 4 and after.token_bytes == leaf.token_bytes
    null_tier_holds(cache)


def _layout(num_blocks: int = NUM_BLOCKS) -> PoolLayout:
    return PoolLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE, num_blocks=num_blocks)


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_a_snapshot_without_a_host_tier_restores_into_either_pool(host_blocks: int) -> None:
    """`"host": None` (every snapshot of a pool without one, before and now) restores, into a pool with a host tier
    as an empty one."""
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    seq = cache.open(BASES[0]).seq_id
    cache.commit([seq], [len(BASES[0])])
    cache.preempt([seq], "recompute")
    identity = PoolIdentity(pool="default", layout=_layout(), memory_id="mem-1")
    data = dump(cache, identity)
    assert load(data, identity).header["host_layout"] is None
    restored = rebuild(capture(cache), host_num_blocks=host_blocks)
    assert restored.host.enabled == bool(host_blocks)
    assert restored.stats().num_host_blocks_free == host_blocks
    if not host_blocks:
        assert fingerprint(restored) == fingerprint(load(data, identity).cache) == fingerprint(cache)
        null_tier_holds(restored)
    assert restored.resume(seq).num_cached_tokens == 8
    restored.check_invariants()


def test_a_host_tier_state_is_refused_by_a_pool_without_one() -> None:
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, host_num_blocks=6)
    seq = cache.open(BASES[0]).seq_id
    cache.commit([seq], [len(BASES[0])])
    cache.release(seq)
    cache.evict(4)  # some of it on the host now
    state = capture(cache)
    assert state["host"] is not None
    with pytest.raises(SnapshotRefused) as refused:
        rebuild(state)
    assert refused.value.metadata["why"] == "INCONSISTENT" and "host tier of 6 blocks" in str(refused.value)


def test_pool_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVCache(0, BLOCK_SIZE)
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        KVCache(NUM_BLOCKS, BLOCK_SIZE, host_num_blocks=-1)
