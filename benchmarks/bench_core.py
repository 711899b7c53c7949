"""Core bookkeeping speed: a seeded serving trace under eviction pressure, match (and explain), evict, memory.

Prints a table and writes JSON. The headline (benchmarks/scheduler_shape.py): the ~3.0M-token trace as a
scheduler sends it (32 requests in flight, a 131,072-token pool; per request match, allocate prompt + output,
write, insert, release), radixkv against SGLang's RadixCache driven call for call as its scheduler drives it,
at block 16 and block 1, engine wall and on-CPU time. Then the same requests one at a time (open on the prompt as
an int32 array, append_batch of the output, cache, release: the vLLM connector's scheduler side, a simple
orchestrator), against SGLang's scheduler path for one request. Then the decode-heavy workload
(benchmarks/decode_floor.py): 256 sequences x 1,000 decode steps, with and without beams, against a minimal
allocator written in the benchmark (the floor). Then the older shapes. Alternatives are compared inside the
same run as ratios: SGLang's RadixCache with its token/paged allocators (on CPU torch) driven over the same trace at
block 16 and block 1, and on the same cached 128k-token match at block 1; the pool at ~15% of the
working set against an infinite cache (hit ratio); tail-trimming LRU eviction against whole-leaf
LRU eviction (SGLang's policy) at the same capacity; a sorted evictable-leaf list against
rebuilding a heap over all leaves per eviction (SGLang's method).

SGLang is optional (see benchmarks/sglang_peer.py); without it the table says so and the rest runs:

    pip install --no-deps --target .peers/sglang sglang==0.5.23
    python benchmarks/bench_core.py [--quick] [--out results.json]

Before and after in one run: `--build DIR` (DIR holds `pip install --no-deps --target DIR .` of another commit)
runs this script on DIR's radixkv and on this one, each in its own process, alternated over `--rounds` rounds
(2 by default), and prints radixkv's own figures for both with their ratio (benchmarks/builds.py). The builds
must share the API this script drives (a build from before the server's regrouping imports its old paths).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import gc
import heapq
import json
import multiprocessing
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

from radixkv import KVCache
from radixkv.planning.workload import Request, WorkingSet, make_trace, replay, working_set

try:
    from radixkv.server.events.hub import EventHub
    from radixkv.server.rules.miss_reasons import explain_miss
    from radixkv.server.rules.tenants import ANONYMOUS
except ImportError:  # a build from before the server's regrouping (--build DIR: the before of issue 41)
    from radixkv.server.events import EventHub  # type: ignore[no-redef]
    from radixkv.server.miss_reasons import explain_miss  # type: ignore[no-redef]
    from radixkv.server.tenants import ANONYMOUS  # type: ignore[no-redef]
from radixkv.tree.radix_tree import RadixTree

sys.path.insert(0, str(Path(__file__).resolve().parent))
import builds  # noqa: E402
import decode_floor  # noqa: E402 - sibling scripts, not a package
import scheduler_shape  # noqa: E402
import sglang_peer  # noqa: E402

BLOCK_SIZE = 16


class WholeLeafTree(RadixTree):
    """The alternative policy: evict whole LRU leaves, as SGLang's RadixCache does."""

    def evict(self, num_blocks: int, namespaces: Callable[[str], bool] | None = None) -> np.ndarray:
        assert namespaces is None, "the replay has no tenant cache shares"
        freed: list[int] = []
        leaves = self._evictable_leaves
        while len(freed) < num_blocks and leaves:
            leaf = leaves.first()
            leaves.remove(leaf)
            freed.extend(leaf.block_ids.tolist())
            self.num_cached_blocks_in[leaf.namespace] -= len(leaf.block_ids)  # tenant shares: unused here, kept exact
            if not self.num_cached_blocks_in[leaf.namespace]:
                del self.num_cached_blocks_in[leaf.namespace]
            self.unlink(leaf, to_host=False)
        self.num_evictable_blocks -= len(freed)
        self.num_cached_blocks -= len(freed)
        return np.asarray(freed, dtype=np.int32)


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
    whole_leaf = KVCache(num_blocks, BLOCK_SIZE, tree=WholeLeafTree(BLOCK_SIZE))
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
        "op_us": {
            op: {"p50": percentile_us(s, 50), "p99": percentile_us(s, 99), "count": len(s)}
            for op, s in timed.op_seconds.items()
        },
    }


def replay_by_kind(cache: KVCache, trace: list[Request], release_after: int = 32) -> dict:
    """The trace through radixkv's public API, engine seconds per request kind, as sglang_peer.replay."""
    seconds: dict[str, float] = collections.defaultdict(float)
    pending: collections.deque = collections.deque()
    clock = time.perf_counter
    start = cache.stats()

    def release(entry: tuple[list[int], str]) -> None:
        t0 = clock()
        cache.release_many(entry[0])
        seconds[entry[1]] += clock() - t0

    for request in trace:
        t0 = clock()
        opened = cache.open(request.prompt, request.namespace)
        cache.commit([opened.seq_id], [len(request.prompt)])  # the prefill wrote the prompt's K/V
        seq_ids = [opened.seq_id]
        if len(request.outputs) > 1:
            seq_ids += cache.fork(opened.seq_id, len(request.outputs) - 1)
        step = cache.append_batch(seq_ids, [len(o) for o in request.outputs], np.concatenate(request.outputs))
        cache.commit(seq_ids, [n - 1 for n in step.num_tokens])  # all but each last token's K/V written
        cache.cache(seq_ids[0])
        seconds[request.kind] += clock() - t0
        pending.append((seq_ids, request.kind))
        if len(pending) > release_after:
            release(pending.popleft())
    while pending:
        release(pending.popleft())
    end = cache.stats()
    requested = end.num_requested_tokens - start.num_requested_tokens
    return {
        "seconds": dict(seconds),
        "total_seconds": sum(seconds.values()),
        "hit_ratio": (end.num_hit_tokens - start.num_hit_tokens) / requested if requested else 0.0,
        "evicted_blocks": end.num_evicted_blocks - start.num_evicted_blocks,
    }


def bench_peer(trace: list[Request], pool_tokens: int, peer: object | None, rounds: int) -> dict:
    """radixkv and SGLang over the same trace and pool (in tokens), block 16 and block 1, best of `rounds`."""
    out: dict = {}
    num_tokens = sum(r.num_tokens for r in trace)
    for block_size in (16, 1):
        row: dict = {}
        engines = {"radixkv": lambda bs=block_size: replay_by_kind(KVCache(pool_tokens // bs, bs), trace)}
        if peer is not None:
            engines["sglang"] = lambda bs=block_size: sglang_peer.replay(peer, trace, pool_tokens, bs)
        for name, run in engines.items():
            best = None
            for _ in range(rounds):
                gc.collect()
                result = run()
                if best is None or result["total_seconds"] < best["total_seconds"]:
                    best = result
            assert best is not None
            best["tokens_per_second"] = num_tokens / best["total_seconds"]
            row[name] = best
        if "sglang" in row:
            row["speedup"] = row["sglang"]["total_seconds"] / row["radixkv"]["total_seconds"]
        out[str(block_size)] = row
    return out


def bench_long_match(num_tokens: int, peer: object | None) -> dict:
    """A cached prompt of `num_tokens` at block 1: radixkv's match, lock_prefix and open against
    SGLang's match_prefix plus the prefix's KV indices (what its scheduler reads)."""
    tokens = np.random.default_rng(7).integers(0, 32000, num_tokens + 1, dtype=np.int32)
    cache = KVCache(num_tokens + 64, 1)
    cache_prompt(cache, tokens)

    def lock_and_release() -> None:
        cache.release(cache.lock_prefix(tokens[:-1]).seq_id)

    def open_and_release() -> None:
        cache.release(cache.open(tokens).seq_id, cache=False)

    out = {
        "radixkv_match_us": best_of(lambda: cache.match(tokens), reps=20) * 1e6,
        "radixkv_lock_prefix_us": best_of(lock_and_release, reps=20) * 1e6,
        "radixkv_open_us": best_of(open_and_release, reps=20) * 1e6,
    }
    if peer is not None:
        engine = sglang_peer.Engine(peer, num_tokens + 64, 1)
        engine.release(engine.open(tokens.tolist(), "default")[0], "default")
        key = engine._key(tokens[:-1].tolist(), "default")  # built once, as a request holds its key

        def sglang_match() -> None:
            match = engine.tree.match_prefix(peer.base.MatchPrefixParams(key=key))
            engine.tree.path_device_indices(match.last_device_node)

        out["sglang_match_us"] = best_of(sglang_match, reps=20) * 1e6
    return out


def bench_explain(num_tokens: int) -> dict:
    """Match against Match with explain, on a cached prompt of `num_tokens` at block 16 plus one fresh
    block: the plain path is the same call with or without the event hub (which explain reads)."""
    tokens = np.random.default_rng(11).integers(0, 32000, num_tokens + BLOCK_SIZE, dtype=np.int32)
    key = tokens.tobytes()
    bare = KVCache(num_tokens // BLOCK_SIZE + 64, BLOCK_SIZE)
    cache_prompt(bare, tokens[:num_tokens])
    watched = KVCache(num_tokens // BLOCK_SIZE + 64, BLOCK_SIZE)
    hub = EventHub(watched, 1)
    cache_prompt(watched, tokens[:num_tokens])

    def explained() -> None:
        explain_miss(watched, hub, ANONYMOUS, key, "default", watched.match(tokens))

    return {
        "tokens": num_tokens,
        "match_us": best_of(lambda: bare.match(tokens), reps=50) * 1e6,
        "match_with_hub_us": best_of(lambda: watched.match(tokens), reps=50) * 1e6,
        "match_explain_us": best_of(explained, reps=50) * 1e6,
    }


def best_of(fn: Callable[[], object], reps: int, rounds: int = 5) -> float:
    """Seconds per call, the best round's mean: the least disturbed by other work on the machine."""
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        gc.disable()  # a collection of the big heap the trace left would land on whichever call runs then
        try:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t0) / reps)
        finally:
            gc.enable()
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
    return {
        "evictable_leaves": len(leaves),
        "evict_us_per_block": sorted_list_s * 1e6,
        "heap_rebuild_us_per_eviction": heap_s * 1e6,
        "speedup": heap_s / sorted_list_s,
    }


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
    gc.collect()
    tracemalloc.start()
    empty = KVCache(1 << 20, BLOCK_SIZE)
    empty_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del empty
    return {
        "cached_blocks": cached,
        "bytes_per_cached_block": (after - before) / cached,
        "token_bytes_per_block": BLOCK_SIZE * 4,
        "empty_pool_bytes_per_block": empty_bytes / (1 << 20),
    }


def peer_rows(results: dict) -> list[tuple[str, str]]:
    """radixkv beside SGLang: engine ms per request kind and in total, tokens/s, hit ratio, evictions."""
    if results["sglang"] is None:
        note = "not installed: pip install --no-deps --target .peers/sglang sglang==" + sglang_peer.SGLANG_VERSION
        rows = [("SGLang RadixCache", note)]
    else:
        rows = [("SGLang RadixCache", f"{results['sglang']} on CPU torch, same trace and pool (ms: radixkv / sglang)")]
    for block_size, row in results["peer"].items():
        ours, theirs = row["radixkv"], row.get("sglang")
        for kind, sec in sorted(ours["seconds"].items()):
            peer_ms = f" / {theirs['seconds'][kind] * 1e3:.0f}" if theirs else ""
            rows.append((f"  block {block_size}: {kind} (ms)", f"{sec * 1e3:.0f}{peer_ms}"))
        total = f"{ours['total_seconds'] * 1e3:.0f}" + (f" / {theirs['total_seconds'] * 1e3:.0f}" if theirs else "")
        speedup = f"  = {row['speedup']:.2f}x faster (target >= 3x)" if theirs else ""
        rows.append((f"  block {block_size}: total (ms)", total + speedup))
        tps = f"{ours['tokens_per_second'] / 1e6:.2f} M" + (
            f" / {theirs['tokens_per_second'] / 1e6:.2f} M" if theirs else ""
        )
        rows.append((f"  block {block_size}: tokens/s", tps))
        hit = f"{ours['hit_ratio']:.3f}" + (f" / {theirs['hit_ratio']:.3f}" if theirs else "")
        rows.append((f"  block {block_size}: hit ratio", hit))
        evicted = f"{ours['evicted_blocks']:,}" + (f" / {theirs['evicted_blocks']:,}" if theirs else "")
        rows.append((f"  block {block_size}: evicted blocks", evicted))
    lm = results["long_match"]
    ours = (
        f"match {lm['radixkv_match_us']:.0f}, lock_prefix {lm['radixkv_lock_prefix_us']:.0f}, "
        f"open {lm['radixkv_open_us']:.0f}"
    )
    theirs = f"; sglang match_prefix {lm['sglang_match_us']:.0f}" if "sglang_match_us" in lm else ""
    rows.append(("cached 128k tokens at block 1 (us)", ours + theirs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under 30 s")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--build", help="also measure the radixkv installed in this directory: before and after")
    parser.add_argument("--rounds", type=int, default=2, help="with --build: rounds of both builds, alternated")
    args = parser.parse_args(argv)
    if args.build is not None:
        return compare_builds(args.build, args.quick, args.rounds, args.out)
    trace_tokens = 300_000 if args.quick else 3_000_000
    leaves = 20_000 if args.quick else 100_000
    peer = sglang_peer.load()
    rounds = 1 if args.quick else 3
    results = {
        "quick": args.quick,
        "load_average": list(__import__("os").getloadavg()),
        "requests": scheduler_shape.bench_requests(make_trace(trace_tokens, seed=0), peer, rounds),
        "one_at_a_time": scheduler_shape.bench_one_at_a_time(make_trace(trace_tokens, seed=0), peer, rounds),
        "decode": decode_floor.bench_decode(100 if args.quick else 1000, 3),
        "trace": bench_trace(trace_tokens),
        "match": bench_match([8192, 32768, 131072]),
        "evict": bench_evict(leaves),
        "memory": bench_memory(16_384 if args.quick else 65_536),
    }
    results["sglang"] = f"sglang {sglang_peer.SGLANG_VERSION}" if peer is not None else None
    pool_tokens = results["trace"]["pool_blocks"] * BLOCK_SIZE
    results["peer"] = bench_peer(make_trace(trace_tokens, seed=0), pool_tokens, peer, rounds=2 if args.quick else 3)
    results["long_match"] = bench_long_match(131_072, peer)
    results["explain"] = x = bench_explain(32_768)
    t, m, e, mem = results["trace"], results["match"], results["evict"], results["memory"]
    rows = [
        ("trace tokens / requests", f"{t['trace_tokens']:,} / {t['trace_requests']:,}"),
        (
            "pool blocks (of working set)",
            f"{t['pool_blocks']:,} ({t['pool_blocks'] / t['working_set_blocks']:.0%} of {t['working_set_blocks']:,})",
        ),
        ("trace tokens/s", f"{t['tokens_per_second'] / 1e6:.2f} M  (target > 15 M)"),
        (
            "hit ratio / infinite cache",
            f"{t['hit_ratio']:.3f} / {t['infinite_cache_hit_ratio']:.3f} = "
            f"{t['hit_ratio'] / t['infinite_cache_hit_ratio']:.3f}",
        ),
        (
            "hit ratio / whole-leaf LRU",
            f"{t['hit_ratio']:.3f} / {t['whole_leaf_lru_hit_ratio']:.3f} = "
            f"{t['hit_ratio'] / t['whole_leaf_lru_hit_ratio']:.3f}",
        ),
        ("evicted blocks", f"{t['evicted_blocks']:,}"),
    ]
    rows = (
        scheduler_shape.rows(results["requests"])
        + scheduler_shape.one_at_a_time_rows(results["one_at_a_time"])
        + decode_floor.rows(results["decode"])
        + rows
    )
    for op, s in t["op_us"].items():
        rows.append((f"{op} p50 / p99 (us)", f"{s['p50']:.1f} / {s['p99']:.1f}  (n={s['count']})"))
    for n, s in m.items():
        rows.append(
            (
                f"match cached {int(n) // 1024}k tokens (us)",
                f"{s['match_us_int32_array']:.1f} int32 array, {s['match_us_python_list']:.0f} Python list",
            )
        )
    rows.append(
        (
            f"evict per block, {e['evictable_leaves']:,} leaves (us)",
            f"{e['evict_us_per_block']:.2f}  vs heap rebuild {e['heap_rebuild_us_per_eviction']:.0f} = "
            f"{e['speedup']:.0f}x",
        )
    )
    rows += peer_rows(results)
    hub_ratio, explain_ratio = x["match_with_hub_us"] / x["match_us"], x["match_explain_us"] / x["match_us"]
    rows.append(
        (
            f"Match {x['tokens'] // 1024}k cached + 1 block (us)",
            f"{x['match_us']:.1f}; with event hub {x['match_with_hub_us']:.1f} = {hub_ratio:.2f}x;"
            f" with explain {x['match_explain_us']:.1f} = {explain_ratio:.2f}x",
        )
    )
    rows.append(("empty pool of 1M blocks, bytes per block", f"{mem['empty_pool_bytes_per_block']:.1f}  (target <= 8)"))
    rows.append(
        (
            "bookkeeping bytes per cached block",
            f"{mem['bytes_per_cached_block']:.0f} (of which token ids {mem['token_bytes_per_block']})",
        )
    )
    width = max(len(k) for k, _ in rows)
    load = ", ".join(f"{x:.1f}" for x in results["load_average"])
    print(f"bench_core (block_size {BLOCK_SIZE} but where a row says{', quick' if args.quick else ''}; load {load})")
    print("-" * (width + 50))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


# radixkv's own figures (the peers' are the same code in both runs): lower or higher is better
BUILD_METRICS = {
    "requests.*.radixkv.*_s": "lower",
    "one_at_a_time.*.radixkv.*_s": "lower",
    "decode.*.radixkv.*_s": "lower",
    "trace.tokens_per_second": "higher",
    "match.*.match_us_int32_array": "lower",
    "evict.evict_us_per_block": "lower",
    "explain.match_us": "lower",
    "memory.bytes_per_cached_block": "lower",
}


def compare_builds(build: str, quick: bool, rounds: int, out: str | None) -> int:
    """This script on `build`'s radixkv and on this one, alternated; each metric's best round of each."""
    names = (f"before ({Path(build).name})", "after (this)")
    runs = builds.run_alternately(
        Path(__file__), {names[0]: build, names[1]: None}, ["--quick"] if quick else [], rounds
    )
    before, after = (builds.best(runs[name], BUILD_METRICS) for name in names)
    load = ", ".join(f"{x:.1f}" for x in __import__("os").getloadavg())
    print(f"bench_core before/after, best of {rounds} alternated rounds each{', quick' if quick else ''} (load {load})")
    print(builds.compare_table(before, after, ("before", "after")))
    if out:
        with open(out, "w") as f:
            json.dump({"builds": dict(zip(("before", "after"), names, strict=True)), "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
