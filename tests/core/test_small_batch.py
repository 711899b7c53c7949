"""The core's one small-batch threshold (`radixkv.memory.block_pool.SMALL_BATCH`), both sides of every site.

Up to SMALL_BATCH items a call goes one by one in Python, past it in numpy; the two must agree. The same seeded
workload (opens that hit and miss, forks, decode and prefill appends with copy-on-write, commits, caches,
releases, under eviction) runs with every site on its loop side and on its numpy side, and every answer and
the final state must be equal, with the invariants holding after each call.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from radixkv import KVCache
from radixkv.errors import OutOfBlocks
from radixkv.memory import block_pool

ALL_NUMPY, ALL_LOOPS = 0, 1 << 20


@contextmanager
def small_batch(value: int) -> Iterator[None]:
    """Every module that imported the threshold sees `value` (each holds its own binding of the name)."""
    modules = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("radixkv.") and getattr(m, "SMALL_BATCH", None) is block_pool.SMALL_BATCH
    ]
    saved = block_pool.SMALL_BATCH
    assert len(modules) >= 4, [m.__name__ for m in modules]  # block_pool, publish, append, sequence
    for m in modules:
        m.SMALL_BATCH = value  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in modules:
            m.SMALL_BATCH = saved  # type: ignore[attr-defined]


def workload(seed: int) -> tuple[list[object], object]:
    """Answers of a seeded run of every kind of call, and the final state it leaves."""
    rng = np.random.default_rng(seed)
    cache = KVCache(num_blocks=160, block_size=4)
    answers: list[object] = []
    live: list[int] = []
    system = list(range(100, 100 + 4 * 5))  # a shared prefix of 5 blocks
    for step in range(40):
        if len(live) < 12:
            prompt = system + rng.integers(0, 50, int(rng.integers(1, 40))).tolist()
            opened = cache.open(np.asarray(prompt, dtype=np.int32), namespace="a" if step % 3 else "b")
            cache.commit([opened.seq_id], [len(prompt)])
            answers.append((opened.num_cached_tokens, opened.block_table.tolist(), np.asarray(opened.slots).tolist()))
            live.append(opened.seq_id)
        if step % 5 == 0 and live:
            children = cache.fork(live[0], int(rng.integers(1, 10)))
            answers.append(children)
            live += children
        counts = [1 if step % 2 else int(rng.integers(1, 9)) for _ in live]
        tokens = rng.integers(0, 50, sum(counts)).tolist()
        try:
            batch = cache.append_batch(live, counts, tokens)
        except OutOfBlocks as refused:  # both sides refuse the same batch, changing nothing
            answers.append(str(refused))
        else:
            answers.append((batch.num_tokens, list(batch.copies), np.asarray(batch.slots).tolist()))
            cache.commit(live, list(batch.num_tokens))
        if step % 4 == 3:
            done, live = live[: len(live) // 2], live[len(live) // 2 :]
            answers.append(cache.release_many(done, cache=True))
        cache.check_invariants()
    return answers, (sorted(cache.sequence_ids()), repr(cache.stats()), sorted(cache.pool.free_block_ids()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_loop_and_numpy_sides_agree_at_every_site(seed: int) -> None:
    with small_batch(ALL_LOOPS):
        loops = workload(seed)
    with small_batch(ALL_NUMPY):
        columns = workload(seed)
    assert loops == columns


def test_the_default_threshold_sees_batches_on_both_sides() -> None:
    """The workload's batches fall on both sides of the default threshold, so the run above compares real shapes."""
    sizes: list[int] = []
    real = KVCache.append_batch

    def counting(self: KVCache, seq_ids: list[int], *args: object, **kwargs: object) -> object:
        sizes.append(len(seq_ids))
        return real(self, seq_ids, *args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KVCache, "append_batch", counting)
        workload(3)
    assert min(sizes) <= block_pool.SMALL_BATCH < max(sizes)
