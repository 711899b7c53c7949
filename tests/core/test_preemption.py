"""Preemption by recompute, resume under the same id, victims, and every refusal (each changes nothing)."""

import pytest

from radixkv import KVCache
from radixkv.errors import (
    FailedPrecondition,
    InvalidArgument,
    OutOfBlocks,
    SequencePreempted,
    UnknownSequence,
)


def snapshot(cache):
    s = cache.stats()
    return (s.num_blocks_free, s.num_blocks_evictable, s.num_blocks_reserved, s.num_live_sequences,
            s.num_preempted_sequences, list(cache.pool.ref_counts), sorted(cache.tree.roots))  # fmt: skip


def written(cache, token_ids, namespace="default", **kwargs):
    r = cache.open(token_ids, namespace, **kwargs)
    cache.commit([r.seq_id], [len(token_ids)])
    return r.seq_id


@pytest.fixture
def cache():
    c = KVCache(num_blocks=16, block_size=4, watermark_fraction=0.0)
    yield c
    c.check_invariants()


def test_recompute_publishes_computed_blocks_and_keeps_the_tokens(cache):
    seq = written(cache, list(range(10)))
    cache.append(seq, [10, 11, 12])  # 13 tokens; the first 10 computed
    predicted = cache.freeable_blocks([seq])
    result = cache.preempt([seq], "recompute")
    assert (result.seq_ids, result.mode, result.offloads.tolist()) == ([seq], "recompute", [])
    assert result.num_freed_blocks == predicted == 4
    assert cache.is_preempted(seq) and cache.sequence_ids() == [] and cache.preempted_sequence_ids() == [seq]
    assert (cache.block_table(seq), cache.num_tokens(seq), cache.num_computed_tokens(seq)) == ([], 13, 0)
    s = cache.stats()
    assert (s.num_blocks_cached, s.num_preempted_sequences, s.num_preemptions_recompute) == (2, 1, 1)
    assert cache.match(list(range(12))) == 8, "its computed full blocks stay cached"
    cache.check_invariants()

    resumed = cache.resume(seq)
    assert resumed.seq_id == seq and resumed.loads.tolist() == []
    assert resumed.num_cached_tokens == 8
    assert len(resumed.block_table) == 4 and cache.block_table(seq) == resumed.block_table.tolist()
    table = resumed.block_table
    assert list(resumed.slots) == [table[p // 4] * 4 + p % 4 for p in range(8, 13)]
    assert (cache.num_tokens(seq), cache.num_computed_tokens(seq)) == (13, 8)
    s = cache.stats()
    assert (s.num_resumed_sequences, s.num_recomputed_tokens, s.num_preempted_sequences) == (1, 5, 0)
    cache.append(seq, [13])  # a live sequence again
    cache.commit([seq], [14])
    cache.release(seq)
    assert cache.match(list(range(14)) + [99]) == 12


def test_resume_recomputes_everything_the_cache_lost(cache):
    seq = written(cache, list(range(10)))
    cache.preempt([seq], "recompute")
    cache.evict(16)
    resumed = cache.resume(seq)
    assert resumed.num_cached_tokens == 0 and len(resumed.slots) == 10
    assert cache.stats().num_recomputed_tokens == 10


def test_a_fully_cached_sequence_still_recomputes_its_last_token(cache):
    seq = written(cache, list(range(8)))
    cache.preempt([seq], "recompute")
    resumed = cache.resume(seq)
    assert resumed.num_cached_tokens == 4 and len(resumed.slots) == 4


def test_preempt_returns_the_reservation_and_resume_takes_it_again(cache):
    seq = written(cache, [1, 2, 3, 4, 5], max_new_tokens=11)  # 2 blocks + 2 reserved
    assert cache.stats().num_blocks_reserved == 2
    result = cache.preempt([seq], "recompute")
    assert cache.stats().num_blocks_reserved == 0 and result.num_unreserved_blocks == 16
    cache.resume(seq)
    assert cache.stats().num_blocks_reserved == 2


def test_resume_that_does_not_fit_is_refused_and_changes_nothing(cache):
    seq = written(cache, list(range(10)), max_new_tokens=6)  # 3 blocks + 1 reserved
    cache.preempt([seq], "recompute")
    cache.evict(16)
    filler = cache.open(list(range(100, 152)))  # 13 of 16 blocks
    before = snapshot(cache)
    with pytest.raises(OutOfBlocks) as refused:
        cache.resume(seq)
    assert (refused.value.needed, refused.value.free) == (4, 3)
    assert snapshot(cache) == before and cache.is_preempted(seq)
    cache.release(filler.seq_id, cache=False)
    assert cache.resume(seq).seq_id == seq


@pytest.mark.parametrize(
    "call",
    [
        lambda c, s: c.append(s, [1]),
        lambda c, s: c.append_batch([s], [1], [1]),
        lambda c, s: c.fork(s, 1),
        lambda c, s: c.cache(s),
        lambda c, s: c.commit([s], [1]),
        lambda c, s: c.can_append([s], [1]),
        lambda c, s: c.freeable_blocks([s]),
        lambda c, s: c.preempt([s], "recompute"),
        lambda c, s: c.check_fork(s, 1),
    ],
)
def test_a_preempted_sequence_refuses_everything_but_resume_and_release(cache, call):
    seq = written(cache, list(range(6)))
    cache.preempt([seq], "recompute")
    before = snapshot(cache)
    with pytest.raises(SequencePreempted) as refused:
        call(cache, seq)
    assert refused.value.reason == "SEQUENCE_PREEMPTED" and refused.value.grpc_code == "FAILED_PRECONDITION"
    assert refused.value.seq_id == seq and refused.value.field in ("seq_id", "seq_ids[0]")
    assert isinstance(refused.value, FailedPrecondition)
    assert snapshot(cache) == before


def test_releasing_a_preempted_sequence_frees_its_tokens(cache):
    seq = written(cache, list(range(6)))
    other = cache.open([7, 7, 7])
    cache.preempt([seq], "recompute")
    cache.release_many([other.seq_id, seq])
    assert cache.stats().num_preempted_sequences == 0 and cache.stats().num_released_sequences == 2
    with pytest.raises(UnknownSequence):
        cache.resume(seq)
    with pytest.raises(UnknownSequence):
        cache.release(seq)


def test_resume_of_a_live_or_unknown_sequence_is_refused(cache):
    seq = written(cache, list(range(6)))
    with pytest.raises(FailedPrecondition) as refused:
        cache.resume(seq)
    assert refused.value.reason == "FAILED_PRECONDITION" and refused.value.metadata["field"] == "seq_id"
    with pytest.raises(UnknownSequence):
        cache.resume(12345)
    with pytest.raises(InvalidArgument):
        cache.resume("1")  # type: ignore[arg-type]


def test_preempt_is_all_or_none(cache):
    a, b = written(cache, [1, 2, 3, 4, 5]), written(cache, [6, 7])
    before = snapshot(cache)
    with pytest.raises(UnknownSequence):
        cache.preempt([a, 999], "recompute")
    cache.preempt([b], "recompute")
    before = snapshot(cache)
    with pytest.raises(SequencePreempted) as refused:
        cache.preempt([a, b], "recompute")
    assert refused.value.field == "seq_ids[1]"
    with pytest.raises(InvalidArgument) as bad:
        cache.preempt([a, a], "recompute")
    assert bad.value.field == "seq_ids"
    assert snapshot(cache) == before


def test_preempt_modes(cache):
    seq = written(cache, [1, 2, 3, 4, 5])
    before = snapshot(cache)
    with pytest.raises(InvalidArgument) as bad:
        cache.preempt([seq], "drop")
    assert bad.value.field == "mode"
    with pytest.raises(FailedPrecondition) as no_tier:
        cache.preempt([seq], "swap")
    assert no_tier.value.metadata["field"] == "mode"
    assert snapshot(cache) == before
    assert cache.preempt([], "recompute").seq_ids == []


def test_a_preempted_fork_parent_leaves_its_children_whole(cache):
    parent = written(cache, list(range(6)))
    children = cache.fork(parent, 2)
    cache.append(children[0], [50])
    cache.preempt([parent], "recompute")
    cache.check_invariants()
    for child in children:
        cache.append(child, [60])
    resumed = cache.resume(parent)
    assert resumed.num_cached_tokens == 4  # the full block the fork published
    cache.check_invariants()


def test_a_lock_prefix_sequence_keeps_its_whole_prefix_when_preempted(cache):
    written(cache, list(range(12)))
    cache.release_many(cache.sequence_ids())
    held = cache.lock_prefix(list(range(12)))
    assert held.num_cached_tokens == 12
    cache.preempt([held.seq_id], "recompute")
    assert cache.num_tokens(held.seq_id) == 12
    resumed = cache.resume(held.seq_id)
    assert resumed.num_cached_tokens == 8 and len(resumed.slots) == 4


def test_victims_go_lowest_priority_then_latest_first(cache):
    low_old = written(cache, [1] * 4, priority=0)  # 1 block each
    high = written(cache, [2] * 4, priority=5)
    low_new = written(cache, [3] * 4, priority=0)
    mid = written(cache, [4] * 8, priority=1)  # 2 blocks
    assert cache.victims(0) == []
    assert cache.victims(1) == [low_new]
    assert cache.victims(2) == [low_new, low_old]
    assert cache.victims(3) == [low_new, low_old, mid]
    assert cache.victims(100) == [low_new, low_old, mid, high], "short of blocks: everyone"
    with pytest.raises(InvalidArgument):
        cache.victims(-1)
    cache.preempt([low_new], "recompute")
    assert cache.victims(1) == [low_old], "a preempted sequence is never a victim"


def test_victims_count_shared_blocks_once_every_holder_is_chosen_and_reservations(cache):
    parent = written(cache, [1] * 6, priority=1)  # 2 blocks
    (child,) = cache.fork(parent, 1)
    budgeted = written(cache, [2] * 4, max_new_tokens=8, priority=1)  # 1 block + 2 reserved: gives 3
    assert cache.victims(3) == [budgeted]
    assert cache.victims(4) == [budgeted, child, parent]  # the child alone frees nothing shared
    assert cache.freeable_blocks([child]) == 0
