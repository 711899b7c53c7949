"""A seeded synthetic serving trace and its replay through a `KVCache`.

The trace mixes what makes prefix caching pay and what makes it hard: chats over a few shared
system prompts, multi-turn conversations whose next turn extends the last, parallel samples
(n = 4-8) of one prompt, and unrelated one-off requests. Replay follows a scheduler's life cycle:
open (match + allocate), append the output, cache, and release a fixed number of requests later.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from radixkv.kv_cache import KVCache

Tokens = npt.NDArray[np.int32]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    kind: str  # "chat", "turn", "samples", "unrelated"
    namespace: str
    prompt: Tokens
    outputs: tuple[Tokens, ...]  # one per parallel sample

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + sum(len(o) for o in self.outputs)


def make_trace(
    total_tokens: int, seed: int = 0, *, num_system_prompts: int = 8, num_namespaces: int = 2
) -> list[Request]:
    """About `total_tokens` tokens of requests (prompt plus outputs), reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    vocab = 32000

    def tokens(n: int | np.integer) -> Tokens:
        return rng.integers(0, vocab, int(n), dtype=np.int32)

    namespaces = [f"tenant-{i}" for i in range(num_namespaces)]
    system_prompts = [tokens(rng.integers(500, 2001)) for _ in range(num_system_prompts)]
    conversations: list[tuple[str, Tokens]] = []
    trace: list[Request] = []
    produced = 0
    while produced < total_tokens:
        kind = rng.choice(["chat", "turn", "samples", "unrelated"], p=[0.4, 0.3, 0.15, 0.15])
        namespace = namespaces[int(rng.integers(len(namespaces)))]
        if kind == "turn" and conversations:
            namespace, history = conversations.pop(int(rng.integers(len(conversations))))
            prompt = np.concatenate([history, tokens(rng.integers(20, 200))])
        elif kind == "unrelated":
            prompt = tokens(rng.integers(200, 1500))
        else:
            system = system_prompts[int(rng.integers(len(system_prompts)))]
            prompt = np.concatenate([system, tokens(rng.integers(50, 300))])
            kind = "chat" if kind == "turn" else kind
        num_samples = int(rng.integers(4, 9)) if kind == "samples" else 1
        outputs = tuple(tokens(rng.integers(100, 400)) for _ in range(num_samples))
        request = Request(kind=str(kind), namespace=namespace, prompt=prompt, outputs=outputs)
        if kind in ("chat", "turn") and len(prompt) < 16_000:
            conversations.append((namespace, np.concatenate([prompt, outputs[0]])))
            if len(conversations) > 256:
                conversations.pop(0)
        trace.append(request)
        produced += request.num_tokens
    return trace


@dataclasses.dataclass(slots=True, kw_only=True)
class ReplayResult:
    num_requests: int
    num_tokens: int
    seconds: float
    hit_ratio: float
    num_evicted_blocks: int
    peak_in_use_blocks: int  # held by live sequences: the least pool that can run this trace
    op_seconds: dict[str, list[float]]


def replay(
    cache: KVCache,
    trace: list[Request],
    *,
    release_after: int = 32,
    timed: bool = False,
    check: Callable[[], None] | None = None,
    before_open: Callable[[Tokens, str], object] | None = None,
) -> ReplayResult:
    """Run the trace through `cache`; with `timed`, record each operation's duration. `before_open(prompt,
    namespace)` runs before each open (a simulated disk tier brings the prompt's blocks into the host tier)."""
    pending: collections.deque[list[int]] = collections.deque()
    op_seconds: dict[str, list[float]] = {"open": [], "fork": [], "append": [], "cache": [], "release": []}
    clock = time.perf_counter
    start_stats = cache.stats()
    peak_in_use = 0
    start = clock()
    for request in trace:
        if before_open is not None:
            before_open(request.prompt, request.namespace)
        t0 = clock()
        opened = cache.open(request.prompt, request.namespace)
        cache.commit([opened.seq_id], [len(request.prompt)])  # the prefill wrote the prompt's K/V
        t1 = clock()
        seq_ids = [opened.seq_id]
        if len(request.outputs) > 1:
            seq_ids += cache.fork(opened.seq_id, len(request.outputs) - 1)
        t2 = clock()
        step = cache.append_batch(seq_ids, [len(o) for o in request.outputs], np.concatenate(request.outputs))
        cache.commit(seq_ids, [n - 1 for n in step.num_tokens])  # decoding wrote all but the last token's K/V
        t3 = clock()
        cache.cache(seq_ids[0])
        t4 = clock()
        pending.append(seq_ids)
        if len(pending) > release_after:
            cache.release_many(pending.popleft())
        t5 = clock()
        if timed:
            op_seconds["open"].append(t1 - t0)
            if len(seq_ids) > 1:
                op_seconds["fork"].append(t2 - t1)
            op_seconds["append"].append(t3 - t2)
            op_seconds["cache"].append(t4 - t3)
            op_seconds["release"].append(t5 - t4)
        if check is not None:
            check()
        peak_in_use = max(peak_in_use, cache.pool.num_blocks - cache.pool.num_free - cache.tree.num_evictable_blocks)
    while pending:
        cache.release_many(pending.popleft())
    seconds = clock() - start
    end_stats = cache.stats()
    requested = end_stats.num_requested_tokens - start_stats.num_requested_tokens
    hits = end_stats.num_hit_tokens - start_stats.num_hit_tokens
    return ReplayResult(
        num_requests=len(trace),
        num_tokens=sum(r.num_tokens for r in trace),
        seconds=seconds,
        hit_ratio=hits / requested if requested else 0.0,
        num_evicted_blocks=end_stats.num_evicted_blocks - start_stats.num_evicted_blocks,
        peak_in_use_blocks=peak_in_use,
        op_seconds=op_seconds,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class WorkingSet:
    num_blocks: int  # what an infinite cache ends up holding
    peak_in_use_blocks: int
    hit_ratio: float  # an infinite cache's: the best any capacity can do


def working_set(trace: list[Request], block_size: int, release_after: int = 32) -> WorkingSet:
    """Replay through a cache that never evicts."""
    num_tokens = sum(r.num_tokens for r in trace)
    cache = KVCache(num_tokens // block_size + 64 * len(trace) + 1024, block_size)
    result = replay(cache, trace, release_after=release_after)
    return WorkingSet(cache.tree.num_cached_blocks, result.peak_in_use_blocks, result.hit_ratio)
