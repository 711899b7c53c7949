"""bench_core's headline: the serving trace as a scheduler sends it, radixkv against SGLang's RadixCache.

Each request of the trace (shared system prompts, multi-turn chats, parallel samples, one-offs) is admitted,
stays in flight while `in_flight` later ones are admitted, then finishes; a fixed pool of `pool_tokens`.

- SGLang, through `sglang_peer.Scheduler` (its scheduler's calls): admit = `match_prefix` with a `RadixKey`
  over the prompt's `array("q")`, `lock`, the token-to-KV allocator for prompt + output (evicting the
  shortfall), the request row's write; finish = `checkpoint` (insert, free the duplicates, re-match, move the
  lock), the free of the row's uncached part, `unlock`. Parallel samples as its TokenizerManager sends them:
  the prompt once with no output (admitted and finished at once, so the prompt is cached), then one request
  per sample.
- radixkv as an orchestrator drives it: admit = `open` (the match, the lock, the prompt's blocks), for
  samples `commit` of the prompt and `fork`, `append_batch` of every output (the output's blocks); finish =
  `commit` of every token (all written), `release_many` with cache (insert into the tree).

Both engines get the tokens as a scheduler holds them, Python lists (a tokenizer's output), converted before
the clock starts; engine time is admit + finish, each engine's own conversion of those lists included
(SGLang's `array("q")`, radixkv's int32 arrays). Wall time and the measuring thread's on-CPU time (`time.thread_time`),
so a neighbour on a shared machine shows as a gap between the two. Hit ratio: prompt tokens served from
the cache at admission, of all prompt tokens (a samples request's prompt counted once, as for radixkv).
"""

from __future__ import annotations

import collections
import gc
import itertools
import time
from collections.abc import Callable

import numpy as np

from radixkv import KVCache
from radixkv.planning.workload import Request

Tokens = tuple[list[int], list[list[int]], str]  # a request's prompt, its outputs (one per sample), its namespace


def as_lists(trace: list[Request]) -> list[Tokens]:
    """The trace as a scheduler holds it: lists of ints, as a tokenizer returns them."""
    return [(r.prompt.tolist(), [o.tolist() for o in r.outputs], r.namespace) for r in trace]


IN_FLIGHT = 32
POOL_TOKENS = 131_072


def radixkv_requests(trace: list[Tokens], pool_tokens: int, block_size: int, in_flight: int = IN_FLIGHT) -> dict:
    cache = KVCache(pool_tokens // block_size, block_size)
    wall = cpu = 0.0
    hits = requested = 0
    pending: collections.deque[tuple[list[int], list[int]]] = collections.deque()
    clock, cpu_clock = time.perf_counter, time.thread_time

    def finish(entry: tuple[list[int], list[int]]) -> None:
        nonlocal wall, cpu
        t0, c0 = clock(), cpu_clock()
        seq_ids, lengths = entry
        cache.commit(seq_ids, lengths)  # every token's K/V is written
        cache.release_many(seq_ids)  # with cache: into the tree
        wall += clock() - t0
        cpu += cpu_clock() - c0

    for prompt, outputs, namespace in trace:
        t0, c0 = clock(), cpu_clock()
        opened = cache.open(prompt, namespace)
        seq_ids = [opened.seq_id]
        if len(outputs) > 1:
            cache.commit(seq_ids, [len(prompt)])  # the prefill wrote the prompt: the samples share it
            seq_ids += cache.fork(opened.seq_id, len(outputs) - 1)
        if len(outputs) == 1:
            tokens = outputs[0]
        elif isinstance(outputs[0], list):
            tokens = list(itertools.chain.from_iterable(outputs))
        else:  # the int32 arrays row
            tokens = np.concatenate(outputs)
        step = cache.append_batch(seq_ids, [len(o) for o in outputs], tokens)
        wall += clock() - t0
        cpu += cpu_clock() - c0
        hits += opened.num_cached_tokens
        requested += len(prompt)
        pending.append((seq_ids, step.num_tokens))
        if len(pending) > in_flight:
            finish(pending.popleft())
    while pending:
        finish(pending.popleft())
    cache.check_invariants()
    stats = cache.stats()
    return {"wall_s": wall, "cpu_s": cpu, "hit_ratio": hits / requested, "evicted_blocks": stats.num_evicted_blocks}


def sglang_requests(
    peer: object, trace: list[Tokens], pool_tokens: int, block_size: int, in_flight: int = IN_FLIGHT
) -> dict:
    import sglang_peer

    max_samples = max(len(outputs) for _, outputs, _ in trace)
    longest = max(len(prompt) + max(len(o) for o in outputs) for prompt, outputs, _ in trace)
    sched = sglang_peer.Scheduler(peer, pool_tokens, block_size, (in_flight + 2) * max_samples, longest + block_size)
    wall = cpu = 0.0
    hits = requested = 0
    pending: collections.deque[list[tuple[object, list[int]]]] = collections.deque()
    clock, cpu_clock = time.perf_counter, time.thread_time

    def finish(entry: list[tuple[object, list[int]]]) -> None:
        nonlocal wall, cpu
        t0, c0 = clock(), cpu_clock()
        for req, output in entry:
            sched.finish(req, output)
        wall += clock() - t0
        cpu += cpu_clock() - c0

    for prompt, outputs, namespace in trace:
        t0, c0 = clock(), cpu_clock()
        if len(outputs) > 1:  # the TokenizerManager's parallel sampling: the prompt alone first
            req, hit = sched.admit(prompt, 0, namespace)
            sched.finish(req, [])
            reqs = [(sched.admit(prompt, len(o), namespace)[0], o) for o in outputs]
        else:
            req, hit = sched.admit(prompt, len(outputs[0]), namespace)
            reqs = [(req, outputs[0])]
        wall += clock() - t0
        cpu += cpu_clock() - c0
        hits += hit
        requested += len(prompt)
        pending.append(reqs)
        if len(pending) > in_flight:
            finish(pending.popleft())
    while pending:
        finish(pending.popleft())
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "hit_ratio": hits / requested,
        "evicted_blocks": sched.num_evicted_tokens // block_size,
    }


def bench_requests(requests: list[Request], peer: object | None, rounds: int, pool_tokens: int = POOL_TOKENS) -> dict:
    """Both engines at block 16 and block 1, `rounds` each, their order alternated round by round; each engine's
    best round by wall time (and by on-CPU time), and the ratios of those from this one run."""
    trace = as_lists(requests)
    arrays: list[Tokens] = [(r.prompt, r.outputs, r.namespace) for r in requests]  # type: ignore[misc]
    out: dict = {"pool_tokens": pool_tokens, "in_flight": IN_FLIGHT, "requests": len(requests),
                 "tokens": sum(r.num_tokens for r in requests), "rounds": rounds}  # fmt: skip
    for block_size in (16, 1):
        engines: dict[str, Callable[[], dict]] = {
            "radixkv": lambda bs=block_size: radixkv_requests(trace, pool_tokens, bs),
            # the same requests for a caller that holds int32 arrays already (no list to pack): a side row
            "radixkv_arrays": lambda bs=block_size: radixkv_requests(arrays, pool_tokens, bs),
        }
        if peer is not None:
            engines["sglang"] = lambda bs=block_size: sglang_requests(peer, trace, pool_tokens, bs)
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for r in range(rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                gc.collect()
                runs[name].append(engines[name]())
        row: dict = {}
        for name, results in runs.items():
            row[name] = dict(min(results, key=lambda x: x["wall_s"]))
            row[name]["cpu_s"] = min(x["cpu_s"] for x in results)
            row[name]["wall_rounds_s"] = [x["wall_s"] for x in results]
        if "sglang" in row:
            row["speedup_wall"] = row["sglang"]["wall_s"] / row["radixkv"]["wall_s"]
            row["speedup_cpu"] = row["sglang"]["cpu_s"] / row["radixkv"]["cpu_s"]
            row["speedup_arrays_cpu"] = row["sglang"]["cpu_s"] / row["radixkv_arrays"]["cpu_s"]
        out[str(block_size)] = row
    return out


def rows(results: dict) -> list[tuple[str, str]]:
    """Table rows: per block size, engine ms (wall, on-CPU) radixkv / sglang and their ratios (both given lists),
    radixkv given int32 arrays instead (on-CPU), hit ratios."""
    head = (f"{results['requests']:,} requests, {results['tokens'] / 1e6:.2f}M tokens, {results['in_flight']} in "
            f"flight, pool {results['pool_tokens']:,} tokens, best of {results['rounds']}")  # fmt: skip
    out = [("HEADLINE scheduler-shaped requests", head)]
    for block_size in ("16", "1"):
        row = results[block_size]
        ours, theirs = row["radixkv"], row.get("sglang")
        for clock in ("wall", "cpu"):
            value = f"{ours[f'{clock}_s'] * 1e3:.0f}"
            if theirs:
                value += f" / {theirs[f'{clock}_s'] * 1e3:.0f} = {row[f'speedup_{clock}']:.2f}x (target >= 3x)"
            out.append((f"  block {block_size}: engine {clock} ms radixkv / sglang", value))
        arrays = f"{row['radixkv_arrays']['cpu_s'] * 1e3:.0f}"
        if theirs:
            arrays += f" / {theirs['cpu_s'] * 1e3:.0f} = {row['speedup_arrays_cpu']:.2f}x"
        out.append((f"  block {block_size}: cpu ms, radixkv given arrays", arrays))
        hit = f"{ours['hit_ratio']:.3f}" + (f" / {theirs['hit_ratio']:.3f}" if theirs else "")
        out.append((f"  block {block_size}: hit ratio radixkv / sglang", hit))
    return out


# -- one request at a time (issue 41): the shape of the vLLM connector's scheduler side and a simple orchestrator --


def radixkv_one_at_a_time(trace: list[tuple[np.ndarray, np.ndarray, str]], pool_tokens: int, block_size: int) -> dict:
    """Each request alone: `open` on the prompt as an int32 array, `commit` of it, `append_batch` of its output,
    `commit` of every token, `cache`, `release_many`; the next request starts after."""
    cache = KVCache(pool_tokens // block_size, block_size)
    clock, cpu_clock = time.perf_counter, time.thread_time
    hits = requested = 0
    t0, c0 = clock(), cpu_clock()
    for prompt, output, namespace in trace:
        opened = cache.open(prompt, namespace)
        seq_ids = [opened.seq_id]
        cache.commit(seq_ids, [len(prompt)])
        step = cache.append_batch(seq_ids, [len(output)], output)
        cache.commit(seq_ids, step.num_tokens)
        cache.cache(opened.seq_id)
        cache.release_many(seq_ids)
        hits += opened.num_cached_tokens
        requested += len(prompt)
    wall, cpu = clock() - t0, cpu_clock() - c0
    cache.check_invariants()
    return {"wall_s": wall, "cpu_s": cpu, "hit_ratio": hits / requested}


def sglang_one_at_a_time(
    peer: object, trace: list[tuple[list[int], list[int], str]], pool_tokens: int, block_size: int
) -> dict:
    """Each request alone through SGLang's scheduler calls (`sglang_peer.Scheduler`: admit, then finish)."""
    import sglang_peer

    longest = max(len(prompt) + len(output) for prompt, output, _ in trace)
    sched = sglang_peer.Scheduler(peer, pool_tokens, block_size, 4, longest + block_size)
    clock, cpu_clock = time.perf_counter, time.thread_time
    hits = requested = 0
    t0, c0 = clock(), cpu_clock()
    for prompt, output, namespace in trace:
        req, hit = sched.admit(prompt, len(output), namespace)
        sched.finish(req, output)
        hits += hit
        requested += len(prompt)
    return {"wall_s": clock() - t0, "cpu_s": cpu_clock() - c0, "hit_ratio": hits / requested}


def bench_one_at_a_time(
    requests: list[Request], peer: object | None, rounds: int, pool_tokens: int = POOL_TOKENS
) -> dict:
    """Both engines at block 16 and block 1 on the trace's requests one at a time (a parallel-samples request as
    its first sample), each engine's best of `rounds` by wall time, order alternated; ratios from this one run."""
    arrays = [(r.prompt.astype(np.int32), r.outputs[0].astype(np.int32), r.namespace) for r in requests]
    lists = [(p.tolist(), o.tolist(), ns) for p, o, ns in arrays]
    out: dict = {"requests": len(requests), "pool_tokens": pool_tokens, "rounds": rounds}
    for block_size in (16, 1):
        engines: dict[str, Callable[[], dict]] = {
            "radixkv": lambda bs=block_size: radixkv_one_at_a_time(arrays, pool_tokens, bs)
        }
        if peer is not None:
            engines["sglang"] = lambda bs=block_size: sglang_one_at_a_time(peer, lists, pool_tokens, bs)
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for r in range(rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                gc.collect()
                runs[name].append(engines[name]())
        row: dict = {name: dict(min(results, key=lambda x: x["wall_s"])) for name, results in runs.items()}
        for name, results in runs.items():
            row[name]["cpu_s"] = min(x["cpu_s"] for x in results)
        if "sglang" in row:
            row["speedup_wall"] = row["sglang"]["wall_s"] / row["radixkv"]["wall_s"]
            row["speedup_cpu"] = row["sglang"]["cpu_s"] / row["radixkv"]["cpu_s"]
        out[str(block_size)] = row
    return out


def one_at_a_time_rows(results: dict) -> list[tuple[str, str]]:
    head = f"{results['requests']:,} requests, pool {results['pool_tokens']:,} tokens, best of {results['rounds']}"
    out = [("PER REQUEST (open int32, append_batch, cache, release)", head)]
    for block_size in ("16", "1"):
        row = results[block_size]
        ours, theirs = row["radixkv"], row.get("sglang")
        for clock in ("wall", "cpu"):
            value = f"{ours[f'{clock}_s'] * 1e3:.0f}"
            if theirs:
                value += f" / {theirs[f'{clock}_s'] * 1e3:.0f} = {row[f'speedup_{clock}']:.2f}x (target >= 1.5x)"
            out.append((f"  block {block_size}: {clock} ms radixkv / sglang", value))
        hit = f"{ours['hit_ratio']:.3f}" + (f" / {theirs['hit_ratio']:.3f}" if theirs else "")
        out.append((f"  block {block_size}: hit ratio radixkv / sglang", hit))
    return out
