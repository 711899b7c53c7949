import numpy as np
import pytest

from radixkv.kv_cache import KVCache
from radixkv.tree.radix_tree import RadixTree, to_token_bytes
from radixkv.tree.tree_check import check_tree

BS = 4


def key(tokens):
    return to_token_bytes(list(tokens))


def insert(tree, namespace, tokens, blocks):
    node, taken = tree.insert(tree.root(namespace), key(tokens), blocks)
    tree.unlock(node)  # insert locks it for the caller
    return node, taken


def test_match_counts_whole_blocks_only():
    tree = RadixTree(BS)
    insert(tree, "a", range(12), [0, 1, 2])
    assert tree.match(tree.root("a"), key(range(12))).num_blocks == 3
    assert tree.match(tree.root("a"), key(range(11))).num_blocks == 2
    assert tree.match(tree.root("a"), key([*range(9), 99, 10, 11])).num_blocks == 2
    assert tree.match(tree.root("a"), key([99, *range(1, 12)])).num_blocks == 0
    check_tree(tree)


def test_match_respects_max_blocks():
    tree = RadixTree(BS)
    insert(tree, "a", range(16), [0, 1, 2, 3])
    assert tree.match(tree.root("a"), key(range(16)), max_blocks=3).num_blocks == 3


def test_insert_splits_node_where_prefixes_diverge():
    tree = RadixTree(BS)
    insert(tree, "a", range(12), [0, 1, 2])
    node, taken = insert(tree, "a", [*range(4), 50, 51, 52, 53], [7, 8])
    assert taken == 1, "the first block was already cached: only the second is new"
    assert node.block_ids.tolist() == [8]
    root = tree.root("a")
    [upper] = root.children.values()
    assert upper.block_ids.tolist() == [0] and len(upper.children) == 2
    assert sorted(tree.tree_block_ids()) == [0, 1, 2, 8]
    check_tree(tree)


def test_insert_keeps_tree_copy_of_duplicate_prefix():
    tree = RadixTree(BS)
    insert(tree, "a", range(8), [0, 1])
    _, taken = insert(tree, "a", range(8), [5, 6])
    assert taken == 0
    assert sorted(tree.tree_block_ids()) == [0, 1]


def test_namespaces_have_separate_roots():
    tree = RadixTree(BS)
    insert(tree, "a", range(8), [0, 1])
    assert tree.match(tree.root("b"), key(range(8))).num_blocks == 0


def test_locked_nodes_are_not_evicted():
    tree = RadixTree(BS)
    node, _ = tree.insert(tree.root("a"), key(range(8)), [0, 1])  # locked for the caller
    assert tree.num_evictable_blocks == 0
    assert tree.evict(2).tolist() == []
    tree.unlock(node)
    assert sorted(tree.evict(2)) == [0, 1]
    check_tree(tree)


def test_eviction_takes_least_recently_used_leaf_first_and_trims_tails():
    tree = RadixTree(BS)
    insert(tree, "a", range(8), [0, 1])  # older
    insert(tree, "a", range(100, 112), [2, 3, 4])  # newer
    assert tree.evict(1).tolist() == [1], "the older leaf loses its tail block first"
    assert tree.evict(2).tolist() == [0, 4], "then the rest of it, then the newer leaf's tail"
    assert tree.num_cached_blocks == 2
    check_tree(tree)


def test_parent_becomes_evictable_after_its_last_child():
    tree = RadixTree(BS)
    insert(tree, "a", range(8), [0, 1])
    insert(tree, "a", [*range(4), 9, 9, 9, 9], [2, 3])
    assert sorted(tree.evict(10)) == [0, 1, 3]
    assert tree.num_cached_blocks == 0
    check_tree(tree)


def test_match_of_a_long_prompt_is_one_node_walk():
    tree = RadixTree(16)
    tokens = np.arange(128 * 1024, dtype=np.int32)
    tree.insert(tree.root("a"), tokens.tobytes(), list(range(8192)))
    match = tree.match(tree.root("a"), tokens.tobytes())
    assert match.num_blocks == 8192 and len(match.path) == 1


class Recorder:
    def __init__(self):
        self.events = []

    def blocks_stored(self, node):
        self.events.append(("stored", node.namespace, list(node.block_ids)))

    def blocks_removed(self, namespace, block_ids):
        self.events.append(("removed", namespace, list(block_ids)))


def test_observer_sees_every_block_stored_and_removed():
    recorder = Recorder()
    tree = RadixTree(BS, observer=recorder)
    insert(tree, "a", range(8), [0, 1])
    insert(tree, "b", range(8), [2, 3])
    insert(tree, "a", range(8), [5, 6])  # a duplicate: nothing new is stored, "a" is touched
    tree.evict(3)
    assert recorder.events == [
        ("stored", "a", [0, 1]),
        ("stored", "b", [2, 3]),
        ("removed", "b", [2, 3]),
        ("removed", "a", [1]),
    ]
    insert(tree, "a", range(20, 28), [7, 8])
    insert(tree, "a", range(40, 44), [9])
    tree.evict(10)
    assert recorder.events[-1] == ("removed", "a", [0, 7, 8, 9]), "one report per namespace per eviction"


def test_check_invariants_catches_an_evictable_list_out_of_order():
    tree = RadixTree(4)
    insert(tree, "a", range(8), [0, 1])
    insert(tree, "a", range(100, 108), [2, 3])
    check_tree(tree)
    older = tree.evictable_leaves()[0]
    older.last_access += 100  # written while listed: the list no longer sorts by its key
    with pytest.raises(AssertionError, match="out of LRU order"):
        check_tree(tree)


def test_eviction_limited_to_namespaces_takes_only_theirs_and_counts_per_namespace() -> None:
    cache = KVCache(num_blocks=16, block_size=2)
    for namespace, first in (("a", 0), ("b", 100), ("a", 200)):
        seq = cache.open([first, first + 1, first + 2, first + 3, first + 4], namespace)
        cache.commit([seq.seq_id], [5])
        cache.release(seq.seq_id)
    cache.check_invariants()
    assert cache.tree.num_cached_blocks_in == {"a": 4, "b": 2}
    assert cache.evict(3, owner="b") == 2, "only b's blocks, however old a's are"
    assert cache.tree.num_cached_blocks_in == {"a": 4}
    assert cache.match([100, 101, 102], "b") == 0 and cache.match([0, 1, 2, 3], "a") == 4
    assert cache.evict(1, owner="a") == 1
    assert cache.tree.num_cached_blocks_in == {"a": 3}
    assert cache.match([0, 1, 2, 3], "a") == 2, "the least recently used of a's leaves lost its tail block"
    cache.check_invariants()


def test_a_node_counts_its_own_holders_and_its_locked_children_once_each():
    tree = RadixTree(BS)
    top, _ = tree.insert(tree.root("a"), key(range(8)), [0, 1])  # locked for the caller
    deep, _ = tree.insert(top, key(range(8, 16)), [2, 3])
    tree.unlock(top)  # the caller's lock moved down (a publish)
    tree.lock(deep, 3)  # three more holders: the walk stops at `deep`, already locked
    assert (deep.lock_ref, top.lock_ref, tree.root("a").lock_ref) == (4, 1, 1)
    check_tree(tree)
    tree.lock(top)  # a holder of the upper half
    assert top.lock_ref == 2 and tree.num_evictable_blocks == 0
    tree.unlock(deep, 4)
    assert (deep.lock_ref, top.lock_ref) == (0, 1) and tree.num_evictable_blocks == 2
    assert tree.evict(4).tolist() == [2, 3], "only the unlocked lower node can go"
    tree.unlock(top)
    assert tree.num_evictable_blocks == 2 and tree.root("a").lock_ref == 0
    check_tree(tree)
