"""Per-owner eviction (issue 42 item 3): an owner's eviction order is the global LRU order restricted to its
namespaces, kept as its own list, so evicting one tenant never looks at another's leaves."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from radixkv import KVCache
from radixkv.errors import OutOfBlocks
from radixkv.tree.radix_tree import owner_of
from tests.examples import examples

NAMESPACES = ["a/x", "a/y", "b/x", "b", "c/z"]  # owners a, b (two namespaces each), c
OWNERS = ["a", "b", "c"]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("cache"), st.sampled_from(NAMESPACES), st.lists(st.integers(0, 5), min_size=1, max_size=9)),
        st.tuples(st.just("hold"), st.sampled_from(NAMESPACES), st.lists(st.integers(0, 5), min_size=2, max_size=9)),
        st.tuples(st.just("let go"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.sampled_from([*OWNERS, None]), st.integers(1, 4)),
    ),
    max_size=60,
)


@settings(max_examples=examples(150), deadline=None)
@given(ops)
# type: ignore[no-untyped-def]
def test_an_owners_eviction_takes_what_the_global_lru_restricted_to_it_would(history) -> None:
    cache = KVCache(num_blocks=48, block_size=2)
    held: list[int] = []
    for op in history:
        try:
            if op[0] in ("cache", "hold"):
                _, namespace, tokens = op
                seq = cache.open(tokens, namespace).seq_id
                cache.commit([seq], [len(tokens)])
                if op[0] == "cache":
                    cache.release(seq)
                else:
                    held.append(seq)
            elif op[0] == "let go" and held:
                cache.release(held.pop(op[1] % len(held)))
        except OutOfBlocks:
            pass
        if op[0] == "evict":
            _, owner, num_blocks = op
            for _ in range(num_blocks):  # one block at a time: each must be the tail of the expected leaf
                leaves = [n for n in cache.tree.evictable_leaves() if owner is None or owner_of(n.namespace) == owner]
                expected = int(leaves[0].block_ids[-1]) if leaves else None
                before = {ns: n for ns, n in cache.tree.num_cached_blocks_in.items()}
                if cache.evict(1, owner) == 0:
                    assert expected is None, "an evictable leaf of the owner was left"
                    break
                assert expected is not None and cache.pool.ref_counts[expected] == 0, "another leaf lost a block"
                changed = {ns for ns, n in before.items() if cache.tree.num_cached_blocks_in.get(ns, 0) != n}
                assert owner is None or {owner_of(ns) for ns in changed} == {owner}
        cache.check_invariants()  # the owner lists are the global list restricted, in order (tree_check)
