import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.errors import OutOfBlocks
from radixkv.memory.block_pool import BlockPool


def test_allocate_hands_out_distinct_blocks_lowest_first():
    pool = BlockPool(8)
    assert pool.allocate(3).tolist() == [0, 1, 2]
    assert pool.allocate(2).tolist() == [3, 4]
    assert pool.num_free == 3
    pool.check_invariants()


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(2)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert info.value.reason == "OUT_OF_BLOCKS"
    assert pool.num_free == 1
    pool.check_invariants()


def test_block_returns_to_free_list_only_at_zero():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.incref([block], by=2)
    pool.decref([block])
    pool.decref([block])
    assert block not in pool.free_block_ids()
    pool.decref([block])
    assert block in pool.free_block_ids()
    pool.check_invariants()


def test_double_release_is_caught_by_the_recount():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.decref([block])
    pool.decref([block])  # the caller's bug: the block goes below 0 and is not freed twice
    assert pool.num_free == 2
    with pytest.raises(AssertionError, match="negative ref_count"):
        pool.check_invariants()


@settings(deadline=None)  # a shared, loaded machine: no per-example time limit on a correctness property
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 6)), max_size=60))
def test_random_operations_keep_counts_consistent(ops):
    pool = BlockPool(16)
    held: dict[int, int] = {}
    for op, n in ops:
        if op == "alloc":
            if n > pool.num_free:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
            else:
                for block in pool.allocate(n).tolist():
                    assert block not in held
                    held[block] = 1
        elif op == "incref" and held:
            block = sorted(held)[n % len(held)]
            pool.incref([block])
            held[block] += 1
        elif op == "decref" and held:
            block = sorted(held)[n % len(held)]
            pool.decref([block])
            held[block] -= 1
            if not held[block]:
                del held[block]
        pool.check_invariants()
        assert pool.num_free == 16 - len(held)
        assert all(pool.ref_counts[b] == c for b, c in held.items())
