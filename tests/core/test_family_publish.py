"""Fork families publish together: a full block that a fork shared before it was computed enters the tree with every
member holding it, never while anyone else still counts it (the tree's blocks have exactly one holder)."""

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from radixkv import KVCache
from radixkv.pressure.preemption import all_token_bytes

BS = 4


def seq(cache, seq_id):
    return cache._sequences.get(seq_id)


def filled_then_forked(cache):
    """A parent whose second block its last append just filled (not computed yet), forked: both share it by count."""
    r = cache.open(list(range(7)))
    cache.commit([r.seq_id], [7])
    cache.append(r.seq_id, [7])
    [child] = cache.fork(r.seq_id)
    full = cache.block_table(r.seq_id)[1]
    assert cache.pool.ref_counts[full] == 2, "the filled block is shared by count"
    assert cache.stats().num_blocks_cached == 1, "only the computed first block was published"
    return r.seq_id, child, full


def test_a_beam_forked_at_a_filled_block_publishes_it_with_its_family():
    cache = KVCache(64, BS)
    parent, child, full = filled_then_forked(cache)
    cache.append_batch([parent, child], [1, 1], [8, 9])  # both have computed the shared block now
    [grandchild] = cache.fork(parent)
    assert cache.pool.ref_counts[full] == 1, "every count moved to the tree's one hold"
    assert cache.stats().num_blocks_cached == 2
    assert cache.match(list(range(8))) == 8
    node = seq(cache, parent).lock_node
    assert node.block_ids.tolist()[-1] == full
    for seq_id in (parent, child, grandchild):
        assert seq(cache, seq_id).lock_node is node and seq(cache, seq_id).num_tree_blocks == 2
        assert full not in seq(cache, seq_id).private_blocks().tolist()
    cache.check_invariants()
    cache.release_many([parent, child, grandchild], cache=False)
    assert cache.match(list(range(8))) == 8, "published blocks stay cached"
    assert cache.stats().num_blocks_evictable == 2
    cache.check_invariants()


def test_a_member_that_has_not_computed_the_block_keeps_it_out_of_the_tree():
    cache = KVCache(64, BS)
    parent, child, full = filled_then_forked(cache)
    cache.append(parent, [8])  # only the parent has computed the shared block
    [grandchild] = cache.fork(parent)
    assert cache.pool.ref_counts[full] == 3, "the child's count is still out: nothing moved"
    assert cache.stats().num_blocks_cached == 1
    cache.check_invariants()
    cache.append(child, [9])  # now every holder has (the grandchild inherited the parent's watermark)
    cache.cache(parent)
    assert cache.pool.ref_counts[full] == 1 and cache.stats().num_blocks_cached == 2
    cache.check_invariants()


def test_a_member_sharing_fewer_blocks_locks_where_it_stops():
    cache = KVCache(64, BS)
    parent, child, full = filled_then_forked(cache)
    cache.append_batch([parent, child], [4, 4], [8, 9, 10, 11, 20, 21, 22, 23])  # each fills a block of its own
    cache.commit([parent], [12])
    cache.cache(parent)  # the shared block with the child, its own with nobody
    upper, lower = seq(cache, child).lock_node, seq(cache, parent).lock_node
    assert lower.parent is upper, "the node was split where the child's share ends"
    assert upper.block_ids.tolist()[-1] == full and lower.block_ids.tolist() == [cache.block_table(parent)[2]]
    assert cache.pool.ref_counts[full] == 1
    assert all_token_bytes(seq(cache, child)) == np.array([*range(8), 20, 21, 22, 23], np.int32).tobytes()
    cache.check_invariants()
    assert cache.freeable_blocks([parent]) == 1, "its own published block: the child locks the rest"
    cache.release_many([parent, child])
    cache.check_invariants()


def test_a_released_member_leaves_its_family():
    cache = KVCache(64, BS)
    parent, child, _ = filled_then_forked(cache)
    family = seq(cache, parent).family
    assert family is seq(cache, child).family and set(family) == {parent, child}
    cache.release(child, cache=False)
    assert seq(cache, parent).family is None, "a family of one is none"
    cache.check_invariants()


@settings(max_examples=40)
@given(st.data())
def test_beam_search_histories_keep_every_sequence_whole(data):
    """Random beam searches (every live beam appends, then forks, releases, commits and caches at random): each
    sequence's tokens stay what it appended, and every hold is recounted after each step."""
    cache = KVCache(400, 2)
    prompt = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=7))
    first = cache.open(prompt).seq_id
    cache.commit([first], [len(prompt)])
    model = {first: list(prompt)}
    for _ in range(data.draw(st.integers(1, 14))):
        beams = sorted(model)
        tokens = data.draw(st.lists(st.integers(0, 3), min_size=len(beams), max_size=len(beams)))
        cache.append_batch(beams, [1] * len(beams), tokens)
        for beam, token in zip(beams, tokens, strict=True):
            model[beam].append(token)
        for _ in range(data.draw(st.integers(0, 3))):
            beam = data.draw(st.sampled_from(sorted(model)))
            op = data.draw(st.sampled_from(["fork", "release", "commit", "cache"]))
            if op == "fork" and len(model) < 6:
                for new in cache.fork(beam, data.draw(st.integers(1, 2))):
                    model[new] = list(model[beam])
            elif op == "release" and len(model) > 1:
                cache.release(beam, cache=data.draw(st.booleans()))
                del model[beam]
            elif op == "commit":
                cache.commit([beam], [len(model[beam])])
            elif op == "cache":
                cache.cache(beam)
            cache.check_invariants()
        for beam, tokens_so_far in model.items():
            assert all_token_bytes(seq(cache, beam)) == np.array(tokens_so_far, np.int32).tobytes()
    cache.release_many(sorted(model))
    cache.check_invariants()
    assert cache.stats().num_blocks_free + cache.stats().num_blocks_evictable == 400
