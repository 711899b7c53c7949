"""A small continuous-batching scheduler over `radixkv.KVCache`, as bench_pressure.py replays its traces.

Each step, in vLLM's order: decode every running sequence (one `append_batch`; on `OutOfBlocks` the
policy picks victims and preempts them until the rest fits), then, unless that step preempted, admit
waiting requests first come first served (preempted ones first) while the step's token budget, the
batch's sequence limit and the policy's memory check allow, and prefill them. A finished request is
released with caching; the next turn of its conversation arrives `think_steps` steps later.

No model runs: outputs are drawn up front, and the counters record what a worker would compute
(prefill tokens, and which of them were computed before: an unbounded "ever computed" tree says) and
move (the blocks the core hands out as offloads and loads).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np
from pressure_policies import Policy
from pressure_trace import TraceRequest

from radixkv import KVCache, OutOfBlocks

NAMESPACE = "default"


@dataclasses.dataclass(slots=True)
class Counters:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # of first opens (a re-open after a preemption is not a new request)
    num_device_hit_tokens: int = 0  # of first opens
    num_host_hit_tokens: int = 0  # of first opens
    num_prefill_tokens: int = 0  # computed by every prefill, re-opens and resumes included
    num_recomputed_tokens: int = 0  # of those, tokens whose K/V had been computed before in the run
    prefill_positions_sum: int = 0  # sum of the prefilled tokens' positions: attention FLOPs grow with it
    num_preemptions: int = 0
    # Re-opens and resumes of preempted requests: their tokens, and how many of those the cache still held.
    num_reopened_tokens: int = 0
    num_reopen_hit_tokens: int = 0
    # Revisits (a conversation's later turns): of the tokens computed before, how many each tier served.
    num_revisit_prior_tokens: int = 0
    num_revisit_device_hit_tokens: int = 0
    num_revisit_host_hit_tokens: int = 0
    num_offloaded_blocks: int = 0  # device -> host (write-back on eviction, swap-out)
    num_loaded_blocks: int = 0  # host -> device (load-back on a hit, swap-in)
    num_generated_tokens: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class Live:
    """A request being served. It holds `len(prompt) + num_generated - 1` tokens, all computed: its
    newest sampled token is appended (and computed) by the next decode step."""

    request: TraceRequest
    arrival: int
    seq_id: int = -1
    num_generated: int = 0
    num_opens: int = 0
    preempted: bool = False  # preempted under its seq_id (swap or recompute): it resumes, not re-opens

    @property
    def context(self) -> np.ndarray:
        """What a (re-)open prefills: the prompt and every token generated so far."""
        return np.concatenate([self.request.prompt, self.request.output[: self.num_generated]])

    @property
    def num_held_tokens(self) -> int:
        return len(self.request.prompt) + self.num_generated - 1


class EverComputed:
    """Every context whose K/V was computed in the run, in an unbounded tree: `match` tells how much of a
    prefill had been computed before (in whole blocks, as any cache would hold it)."""

    def __init__(self, num_tokens: int, block_size: int) -> None:
        self.cache = KVCache(num_tokens // block_size + 1024, block_size)

    def add(self, token_ids: np.ndarray) -> None:
        opened = self.cache.open(token_ids, NAMESPACE)
        self.cache.commit([opened.seq_id], [len(token_ids)])
        self.cache.release(opened.seq_id)

    def match(self, token_ids: np.ndarray) -> int:
        return self.cache.match(token_ids, NAMESPACE)


class Scheduler:
    """Serves a trace to completion through `policy`; `counters` says what it cost."""

    def __init__(
        self, cache: KVCache, policy: Policy, *, max_num_seqs: int, max_batch_tokens: int, num_trace_tokens: int
    ) -> None:
        self.cache, self.policy = cache, policy
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.counters = Counters()
        self.ever = EverComputed(num_trace_tokens, cache.block_size)
        self.waiting: collections.deque[Live] = collections.deque()
        self.running: list[Live] = []
        self._arrivals: list[tuple[int, int, TraceRequest]] = []  # (due step, arrival, request), a heap
        self._num_arrived = 0
        self._followers: dict[str, list[TraceRequest]] = collections.defaultdict(list)

    def run(self, requests: Sequence[TraceRequest]) -> Counters:
        """Serve every request. Raises RuntimeError when the pool cannot hold even one request alone."""
        for r in requests:
            if r.follows is None:
                self._arrive(r, 0)
            else:
                self._followers[r.follows].append(r)
        step = 0
        while self.waiting or self.running or self._arrivals:
            step += 1
            while self._arrivals and self._arrivals[0][0] <= step:
                self.waiting.append(Live(heapq.heappop(self._arrivals)[2], self._num_arrived))
                self._num_arrived += 1
            preempted = self._decode(step) if self.running else False
            if not preempted:
                self._admit(step)
            if not self.running and self.waiting and not self._arrivals:
                head = self.waiting[0].request
                raise RuntimeError(f"the pool cannot hold request {head.name} ({head.num_tokens} tokens) alone")
        self.counters.num_steps = step
        stats = self.cache.stats()  # every block moved, by write-back, load-back, swap out or in
        self.counters.num_offloaded_blocks = stats.num_offloaded_blocks
        self.counters.num_loaded_blocks = stats.num_loaded_blocks
        return self.counters

    def _arrive(self, request: TraceRequest, due: int) -> None:
        heapq.heappush(self._arrivals, (due, self._num_arrived + len(self._arrivals), request))

    # -- decode ----------------------------------------------------------------------------------

    def _decode(self, step: int) -> bool:
        """Append each running sequence's newest token; preempt until the step fits. True if it preempted."""
        preempted = False
        while self.running:
            try:
                self.cache.append_batch(
                    [live.seq_id for live in self.running],
                    [1] * len(self.running),
                    np.fromiter((live.request.output[live.num_generated - 1] for live in self.running), np.int32),
                )
                break
            except OutOfBlocks as e:
                if len(self.running) == 1:
                    raise RuntimeError(
                        f"the pool cannot hold request {self.running[0].request.name} alone: {e}"
                    ) from None
                for victim in self.policy.victims(self.cache, self.running, e.needed - e.free):
                    self.running.remove(victim)
                    self.cache.commit([victim.seq_id], [victim.num_held_tokens])  # every token it holds is computed
                    self.ever.add(victim.context[: victim.num_held_tokens])
                    self.policy.preempt(self.cache, victim, self.counters)
                    self.waiting.appendleft(victim)
                    self.counters.num_preemptions += 1
                preempted = True
        for live in self.running:
            live.num_generated += 1
            self.counters.num_generated_tokens += 1
        self._finish(step)
        return preempted

    def _finish(self, step: int) -> None:
        done = [live for live in self.running if live.num_generated == len(live.request.output)]
        for live in done:
            self.running.remove(live)
            self.cache.commit([live.seq_id], [live.num_held_tokens])
            self.cache.release(live.seq_id, cache=True)
            self.ever.add(live.context[: live.num_held_tokens])
            for follower in self._followers.pop(live.request.name, []):
                self._arrive(follower, step + follower.think_steps)

    # -- admission and prefill -------------------------------------------------------------------

    def _admit(self, step: int) -> None:
        budget = self.max_batch_tokens - len(self.running)
        admitted: list[Live] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            live = self.waiting[0]
            # A preempted sequence that kept its id resumes its held tokens, and its next decode appends the
            # token it had sampled; a new (or released) one opens its whole context and samples from the prefill.
            context = live.context[: live.num_held_tokens] if live.preempted else live.context
            num_new = len(context) - self.cache.match(context, NAMESPACE)
            if (admitted or self.running) and num_new > budget:
                break
            num_running = len(self.running) + len(admitted)
            if live.preempted:
                restored = self.policy.resume(self.cache, live, self.counters)
                hits = None if restored is None else (restored, 0)
            else:
                hits = self.policy.admit(self.cache, live, context, num_running, self.counters)
            if hits is None:
                break
            self.waiting.popleft()
            self._count_prefill(live, context, *hits)
            budget -= len(context) - sum(hits)
            if live.preempted:
                live.preempted = False
            else:
                live.num_generated += 1  # the prefill's last logits sample the next token
                self.counters.num_generated_tokens += 1
            live.num_opens += 1
            admitted.append(live)
        self.running += admitted
        self._finish(step)

    def _count_prefill(self, live: Live, context: np.ndarray, device_hits: int, host_hits: int) -> None:
        c = self.counters
        computed_before = min(self.ever.match(context), len(context))
        num_prefill = len(context) - device_hits - host_hits
        c.num_prefill_tokens += num_prefill
        c.num_recomputed_tokens += max(0, computed_before - device_hits - host_hits)
        start = device_hits + host_hits
        c.prefill_positions_sum += (start + len(context) - 1) * num_prefill // 2
        if live.num_opens:
            c.num_reopened_tokens += len(context)
            c.num_reopen_hit_tokens += device_hits + host_hits
        else:  # a request's first open
            c.num_prompt_tokens += len(context)
            c.num_device_hit_tokens += device_hits
            c.num_host_hit_tokens += host_hits
            if live.request.follows is not None:
                c.num_revisit_prior_tokens += computed_before
                c.num_revisit_device_hit_tokens += min(device_hits, computed_before)
                c.num_revisit_host_hit_tokens += min(host_hits, max(0, computed_before - device_hits))
        self.cache.commit([live.seq_id], [len(context)])
        self.cache.cache(live.seq_id)  # requests admitted while it runs hit its prompt
        self.ever.add(context)
