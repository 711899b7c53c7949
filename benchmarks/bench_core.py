"""Core bookkeeping speed: a seeded serving trace under eviction pressure, match, evict, memory.

Prints a table and writes JSON. Alternatives are compared inside the same run as ratios:
the pool at ~15% of the working set against an infinite cache (hit ratio), tail-trimming LRU
eviction against whole-leaf LRU eviction (SGLang's policy) at the same capacity, and a sorted
evictable-leaf list against rebuilding a heap over all leaves per eviction (SGLang's method).

    python benchmarks/bench_core.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import heapq
import json
import multiprocessing
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from radixkv import KVCache
from radixkv.radix_tree import RadixTree
from radixkv.workload import WorkingSet, make_trace, replay, working_set

BLOCK_SIZE = 16


class WholeLeafTree(RadixTree):
    """The alternative policy: evict whole LRU leaves, as SGLang's RadixCache does."""

    def evict(self, num_blocks: int) -> list[int]:
        freed: list[int] = []
        leaves = self._evictable_leaves
        while len(freed) < num_blocks and leaves:
            leaf = leaves.pop(0)
            freed.extend(leaf.block_ids)
            self._detach(leaf)
        self.num_evictable_blocks -= len(freed)
        self.num_cached_blocks -= len(freed)
        return freed


def cache_prompt(cache: KVCache, tokens: np.ndarray) -> None:
    """Open `tokens`, write their K/V (commit) and release them cached."""
    seq_id = cache.open(tokens).seq_id
    cache.commit([seq_id], [len(tokens)])
    cache.release(seq_id)


def percentile_us(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q) * 1e6) if samples else 0.0


def trace_working_set(total_tokens: int) -> WorkingSet:
    return working_set(make_trace(total_tokens, seed=0), BLOCK_SIZE)


def bench_trace(total_tokens: int) -> dict:
    # The infinite cache runs in a child process: its millions of short-lived objects would leave
    # this process's heap fragmented and slow the timed replays below by ~10%.
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        infinite = pool.submit(trace_working_set, total_tokens).result()
    trace = make_trace(total_tokens, seed=0)
    # ~15% of the working set, but never less than the live requests need at once (short traces).
    num_blocks = max(int(infinite.num_blocks * 0.15), int(infinite.peak_in_use_blocks * 1.2))
    best = None
    for _ in range(5):  # best of five: this machine is shared
        cache = KVCache(num_blocks, BLOCK_SIZE)
        gc.collect()
        result = replay(cache, trace, timed=False)
        if best is None or result.seconds < best.seconds:
            best = result
    timed_cache = KVCache(num_blocks, BLOCK_SIZE)
    timed = replay(timed_cache, trace, timed=True)
    whole_leaf = KVCache(num_blocks, BLOCK_SIZE)
    whole_leaf.tree = WholeLeafTree(BLOCK_SIZE)
    whole_leaf_result = replay(whole_leaf, trace)
    assert best is not None
    return {
        "trace_tokens": best.num_tokens,
        "trace_requests": best.num_requests,
        "pool_blocks": num_blocks,
        "working_set_blocks": infinite.num_blocks,
        "seconds": best.seconds,
        "tokens_per_second": best.num_tokens / best.seconds,
        "hit_ratio": best.hit_ratio,
        "infinite_cache_hit_ratio": infinite.hit_ratio,
        "whole_leaf_lru_hit_ratio": whole_leaf_result.hit_ratio,
        "evicted_blocks": best.num_evicted_blocks,
        "op_us": {op: {"p50": percentile_us(s, 50), "p99": percentile_us(s, 99), "count": len(s)} for op, s in timed.op_seconds.items()},
    }


def best_of(fn: Callable[[], object], reps: int, rounds: int = 5) -> float:
    """Seconds per call, the best round's mean: the least disturbed by other work on the machine."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def bench_match(lengths: list[int]) -> dict:
    out = {}
    for n in lengths:
        cache = KVCache(n // BLOCK_SIZE + 8, BLOCK_SIZE)
        tokens = np.random.default_rng(n).integers(0, 32000, n, dtype=np.int32)
        cache_prompt(cache, tokens)
        assert cache.match(tokens) == n
        as_list = tokens.tolist()
        array_s = best_of(lambda: cache.match(tokens), reps=50)  # noqa: B023 - called before the loop moves on
        list_s = best_of(lambda: cache.match(as_list), reps=5)  # noqa: B023
        out[str(n)] = {"match_us_int32_array": array_s * 1e6, "match_us_python_list": list_s * 1e6}
    return out


def bench_evict(num_leaves: int) -> dict:
    cache = KVCache(num_leaves + 16, BLOCK_SIZE)
    rng = np.random.default_rng(1)
    for i in range(num_leaves):
        tokens = rng.integers(0, 32000, BLOCK_SIZE + 1, dtype=np.int32)
        tokens[0] = i % 30000  # distinct first tokens spread the leaves over the root
        cache_prompt(cache, tokens)
    leaves = cache.tree.evictable_leaves()
    assert len(leaves) >= num_leaves * 0.99, "leaves collided"
    n = min(10_000, num_leaves // 2)
    t0 = time.perf_counter()
    for _ in range(n):
        cache.pool.free_exclusive(cache.tree.evict(1))
    sorted_list_s = (time.perf_counter() - t0) / n
    cache.check_invariants()
    # The alternative: rebuild a heap over every leaf on each eviction call (SGLang's evict()).
    remaining = cache.tree.evictable_leaves()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        heap = [(leaf.last_access, leaf.node_id) for leaf in remaining]
        heapq.heapify(heap)
        heapq.heappop(heap)
    heap_s = (time.perf_counter() - t0) / reps
    return {"evictable_leaves": len(leaves), "evict_us_per_block": sorted_list_s * 1e6, "heap_rebuild_us_per_eviction": heap_s * 1e6, "speedup": heap_s / sorted_list_s}


def bench_memory(num_cached_blocks: int) -> dict:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = KVCache(num_cached_blocks + 16, BLOCK_SIZE)
    rng = np.random.default_rng(2)
    prompt_blocks = 64
    for i in range(num_cached_blocks // prompt_blocks):
        tokens = rng.integers(0, 32000, prompt_blocks * BLOCK_SIZE + 1, dtype=np.int32)
        tokens[0] = i
        cache_prompt(cache, tokens)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    cached = cache.stats().num_blocks_cached
    return {"cached_blocks": cached, "bytes_per_cached_block": (after - before) / cached, "token_bytes_per_block": BLOCK_SIZE * 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under 30 s")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    trace_tokens = 300_000 if args.quick else 3_000_000
    leaves = 20_000 if args.quick else 100_000
    results = {
        "quick": args.quick,
        "trace": bench_trace(trace_tokens),
        "match": bench_match([8192, 32768, 131072]),
        "evict": bench_evict(leaves),
        "memory": bench_memory(16_384 if args.quick else 65_536),
    }
    t, m, e, mem = results["trace"], results["match"], results["evict"], results["memory"]
    rows = [
        ("trace tokens / requests", f"{t['trace_tokens']:,} / {t['trace_requests']:,}"),
        ("pool blocks (of working set)", f"{t['pool_blocks']:,} ({t['pool_blocks'] / t['working_set_blocks']:.0%} of {t['working_set_blocks']:,})"),
        ("trace tokens/s", f"{t['tokens_per_second'] / 1e6:.2f} M  (target > 15 M)"),
        ("hit ratio / infinite cache", f"{t['hit_ratio']:.3f} / {t['infinite_cache_hit_ratio']:.3f} = {t['hit_ratio'] / t['infinite_cache_hit_ratio']:.3f}"),
        ("hit ratio / whole-leaf LRU", f"{t['hit_ratio']:.3f} / {t['whole_leaf_lru_hit_ratio']:.3f} = {t['hit_ratio'] / t['whole_leaf_lru_hit_ratio']:.3f}"),
        ("evicted blocks", f"{t['evicted_blocks']:,}"),
    ]
    for op, s in t["op_us"].items():
        rows.append((f"{op} p50 / p99 (us)", f"{s['p50']:.1f} / {s['p99']:.1f}  (n={s['count']})"))
    for n, s in m.items():
        rows.append((f"match cached {int(n) // 1024}k tokens (us)", f"{s['match_us_int32_array']:.1f} int32 array, {s['match_us_python_list']:.0f} Python list"))
    rows.append((f"evict per block, {e['evictable_leaves']:,} leaves (us)", f"{e['evict_us_per_block']:.2f}  vs heap rebuild {e['heap_rebuild_us_per_eviction']:.0f} = {e['speedup']:.0f}x"))
    rows.append(("bookkeeping bytes per cached block", f"{mem['bytes_per_cached_block']:.0f} (of which token ids {mem['token_bytes_per_block']})"))
    width = max(len(k) for k, _ in rows)
    print(f"bench_core (block_size {BLOCK_SIZE}{', quick' if args.quick else ''})")
    print("-" * (width + 50))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
