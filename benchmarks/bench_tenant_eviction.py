"""One small tenant's cached release, evicted back to its cache share, next to a big tenant's cache: the lock time.

The server keeps each tenant's cached blocks within its share (`Checks.keep_cache_share`): after a call that
caches, the tenant's own least recently used leaves past it are evicted, under the pool's lock. Here, in this
process, on the core that call runs on: tenant `big` caches N one-block prompts (older than everything of
`small`'s), then `small`, already at its share, caches a 64-block prompt and evicts 64 blocks of its own, as
the server does. Per N: the median time of that release + eviction (what one call holds the lock for), the
leaves eviction looked at (`RadixTree.num_leaves_visited`), and the leaves a scan of the global LRU list for
`small`'s first one would pass (what eviction looked at before per-tenant order: issue 42, item 3).

    python benchmarks/bench_tenant_eviction.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from radixkv import KVCache
from radixkv.tree.radix_tree import owner_of

BLOCK_SIZE = 16
SHARE = 64  # small's cached blocks
PROMPT_BLOCKS = 64  # what each of small's releases caches, and evicts again
ROUNDS = 21


def _cache(cache: KVCache, namespace: str, tokens: list[int]) -> None:
    seq = cache.open(tokens, namespace).seq_id
    cache.commit([seq], [len(tokens)])
    cache.release(seq)


def measure(num_big: int, rounds: int) -> dict[str, float]:
    cache = KVCache(num_big + SHARE + 2 * PROMPT_BLOCKS + 64, BLOCK_SIZE)
    for p in range(num_big):  # one block each, the oldest leaves of the tree
        _cache(cache, "big/chat", [p] * BLOCK_SIZE + [0])
    tree = cache.tree
    for p in range(SHARE):
        _cache(cache, "small/chat", [2_000_000_000 - p] * BLOCK_SIZE)
    seconds, visited, scanned = [], [], []
    for r in range(rounds):
        tokens = [10**9 + r * PROMPT_BLOCKS * BLOCK_SIZE + t for t in range(PROMPT_BLOCKS * BLOCK_SIZE)]
        first_small = next(i for i, n in enumerate(tree.evictable_leaves()) if owner_of(n.namespace) == "small")
        before = tree.num_leaves_visited
        start = time.perf_counter()
        _cache(cache, "small/chat", tokens)  # the release that caches ...
        over = tree.num_cached_blocks_of["small"] - SHARE
        cache.evict(over, "small")  # ... and the eviction back to the share, as Checks.keep_cache_share does
        seconds.append(time.perf_counter() - start)
        visited.append(tree.num_leaves_visited - before)
        scanned.append(first_small + 1)
    assert tree.num_cached_blocks_of["big"] == num_big, "the big tenant lost blocks"
    if num_big <= 10_000:  # a full recount: only where it is quick
        cache.check_invariants()
    return {
        "big_prompts": num_big,
        "median_ms": statistics.median(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "leaves_visited": statistics.median(visited),
        "global_scan_leaves": statistics.median(scanned),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 10k prompts of the big tenant (seconds)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    rounds = 7 if args.quick else ROUNDS
    rows = []
    print(f"{'big prompts':>12} {'median':>10} {'max':>10} {'leaves visited':>15} {'global scan (before)':>21}")
    for num_big in sizes:
        row = measure(num_big, rounds)
        rows.append(row)
        print(
            f"{num_big:>12,} {row['median_ms']:>8.2f}ms {row['max_ms']:>8.2f}ms {row['leaves_visited']:>15.0f} "
            f"{row['global_scan_leaves']:>21,.0f}"
        )
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "tenant_eviction", "quick": args.quick, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
