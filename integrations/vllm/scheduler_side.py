"""The connector in vLLM's scheduler process: radixkv over gRPC (`RadixKVClient`), one sequence per request.

vLLM's scheduler calls, per step: `num_new_matched_tokens` for a waiting request (a Match: whole blocks past
vLLM's own hit, at least one prompt token left to compute; radixkv's device, host and disk tiers alike),
`after_alloc` once its blocks exist (the Open that locks radixkv's prefix and gives blocks for the rest, with
the host tier's transfers the worker applies first, and the saver's digests of the blocks to load; a prompt
whose every full block vLLM holds itself costs no call at all: it was saved when vLLM computed or loaded it),
`build_plan` (the worker's loads and saves), `worker_reported` with what the worker saved (one Step commits and
caches every request's new blocks, then their checksums are recorded), `finished` (release once no save of the
request is in flight, on a thread of its own: vLLM's step does not wait for it). A radixkv call that fails never
fails vLLM: the request falls back to computing, and what it was promised and cannot get is reported as a failed
load, which vLLM recomputes. After a failed call the connector asks nothing new of radixkv for `RETRY_AFTER`
seconds (a server that is down costs each request one failed call at most, not a retried one), but still
releases what it holds; a refusal (OutOfBlocks for an open on a full pool) only costs that request its loads and
saves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixkv.client import RadixKVClient
from radixkv.errors import RadixKVError
from radixkv.sequences.step import Commit, Step
from radixkv.vllm.plan import StepPlan, Tracked

log = logging.getLogger("radixkv.vllm")
RETRY_AFTER = 5.0  # seconds without new matches or opens after a call failed


class SchedulerSide:
    def __init__(self, client: RadixKVClient, block_size: int, namespace: str) -> None:
        self.client = client
        self.block_size = block_size
        self.namespace = namespace
        self.requests: dict[str, Tracked] = {}
        self._asked: dict[str, int] = {}  # request -> the local hit it was last asked about (block-aligned)
        self._held_locally: set[str] = set()  # requests whose every full block vLLM held: no radixkv call at all
        self._plan = StepPlan()  # what the next metadata carries (loads and failures planned at allocation)
        self._planned_saves: dict[str, set[int]] = {}  # saves handed to the worker, awaiting its report
        self._quiet_until = 0.0  # monotonic time before which no match or open is tried (a call failed)
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="radixkv-release")  # in order, off the step

    def _failed(self, what: str, error: Exception) -> None:
        """Log a failed call; one that did not reach radixkv (down, unreachable) quiets new calls for a while."""
        log.warning("radixkv %s failed, computing instead: %s", what, error)
        if not isinstance(error, RadixKVError):  # a refusal (OutOfBlocks, ...) says the server is up
            self._quiet_until = time.monotonic() + RETRY_AFTER

    def _quiet(self) -> bool:
        return time.monotonic() < self._quiet_until

    def namespace_of(self, request: Any) -> str | None:
        """radixkv's namespace for a request: vLLM's cache salt and LoRA adapter separate prefixes as its own
        prefix cache does; None for a request whose tokens do not name its K/V (multimodal inputs)."""
        if getattr(request, "mm_features", None):
            return None
        namespace = self.namespace
        if getattr(request, "cache_salt", None):
            namespace += f"/salt:{request.cache_salt}"
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            namespace += f"/lora:{lora.lora_name}"
        return namespace

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens radixkv holds past vLLM's local hit, whole blocks, leaving at least one prompt token."""
        prompt, namespace = request.prompt_token_ids, self.namespace_of(request)
        if not prompt or namespace is None:
            return 0
        usable = (len(prompt) - 1) // self.block_size * self.block_size
        if num_computed_tokens >= usable:  # vLLM holds it all: it was saved when computed (or loaded from radixkv)
            self._held_locally.add(request.request_id)
            return 0
        self._held_locally.discard(request.request_id)
        if self._quiet():
            return 0  # radixkv just failed: no call
        try:
            held = self.client.match_loadable(prompt, namespace)
        except Exception as e:  # the server down or refusing: compute instead
            self._failed("match", e)
            return 0
        self._asked[request.request_id] = num_computed_tokens
        return max(0, min(held, usable) - num_computed_tokens)

    def after_alloc(self, request: Any, vllm_blocks: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: open its sequence (once), plan the promised loads."""
        req_id = request.request_id
        tracked = self.requests.get(req_id)
        if tracked is None:
            tracked = self.requests[req_id] = self._open(request, skip=req_id in self._held_locally)
        local = self._asked.pop(req_id, 0)
        if num_external_tokens <= 0:
            return
        first, last = local // self.block_size, (local + num_external_tokens) // self.block_size
        num_loadable = max(0, min(last, tracked.num_committed_blocks) - first)  # held: locked or committed
        checksums: list[bytes] = []
        if num_loadable and tracked.seq_id is not None:
            try:
                checksums = self.client.checksums.get(tracked.seq_id, first, num_loadable)
            except Exception as e:
                self._failed(f"checksums of {last - first} promised blocks", e)
        tracked.plan_loads(self._plan, first, last, vllm_blocks, checksums)

    def _open(self, request: Any, skip: bool) -> Tracked:
        """The request's radixkv sequence; none (no call) when `skip`: vLLM holds the whole prompt itself."""
        prompt = request.prompt_token_ids or []
        namespace = self.namespace_of(request)
        if not skip and namespace is not None and len(prompt) >= self.block_size and not self._quiet():
            try:
                opened = self.client.open(prompt, namespace)
                if len(opened.offloads) or len(opened.loads):  # the host tier's (and the disk's hits through it)
                    self._plan.transfers.append((opened.offloads, opened.loads))
                held = opened.num_cached_tokens // self.block_size
                table = [int(b) for b in opened.block_table]
                return Tracked(
                    req_id=request.request_id,
                    seq_id=opened.seq_id,
                    table=table,
                    num_prompt_tokens=len(prompt),
                    num_committed_blocks=held,
                    next_save=held,
                    block_size=self.block_size,
                )
            except Exception as e:
                self._failed(f"open of request {request.request_id}", e)
        return Tracked(
            req_id=request.request_id,
            seq_id=None,
            table=[],
            num_prompt_tokens=len(prompt),
            num_committed_blocks=0,
            next_save=0,
            block_size=self.block_size,
        )

    def build_plan(self, scheduled: Iterable[tuple[str, int]], block_ids_of: Any) -> StepPlan:
        """The worker's plan for this step. `scheduled`: (request id, tokens computed after this step)."""
        plan, self._plan = self._plan, StepPlan()
        for req_id, num_computed in scheduled:
            tracked = self.requests.get(req_id)
            if tracked is not None:
                tracked.plan_saves(plan, num_computed, block_ids_of(req_id))
        for req_id, index in zip(plan.saves.req_ids, plan.saves.indices, strict=True):
            self._planned_saves.setdefault(req_id, set()).add(index)
        return plan

    def worker_reported(self, saved: dict[str, dict[int, bytes]]) -> None:
        """The worker finished the step's saves (`saved`: request -> block index -> digest): commit and cache
        them in one step, record their checksums; then release requests vLLM finished meanwhile."""
        planned, self._planned_saves = self._planned_saves, {}
        ready: list[tuple[Tracked, int, list[bytes]]] = []
        for req_id, indices in planned.items():
            tracked = self.requests.get(req_id)
            if tracked is not None:
                first, checksums = tracked.take_saved(saved.get(req_id, {}), indices)
                if checksums:
                    ready.append((tracked, first, checksums))
        if ready:
            self._commit(ready)
        for tracked in [t for t in self.requests.values() if t.finished and not t.in_flight]:
            self._release(tracked)

    def _commit(self, ready: list[tuple[Tracked, int, list[bytes]]]) -> None:
        ids = [t.seq_id for t, _, _ in ready]
        tokens = [t.num_committed_blocks * self.block_size for t, _, _ in ready]
        try:
            self.client.step(Step(commit=Commit(ids, tokens), caches=ids))  # type: ignore[arg-type]
            for tracked, first, checksums in ready:
                self.client.checksums.record(tracked.seq_id, first, checksums)  # type: ignore[arg-type]
        except Exception as e:  # what was not cached is a miss later, never wrong bytes
            self._failed("commit (those blocks stay uncached)", e)

    def finished(self, req_id: str) -> None:
        """vLLM finished the request: release its sequence now, or after the saves in flight are reported."""
        self._asked.pop(req_id, None)
        self._held_locally.discard(req_id)
        tracked = self.requests.get(req_id)
        if tracked is None:
            return
        tracked.finished = True
        if not tracked.in_flight:
            self._release(tracked)

    def _release(self, tracked: Tracked) -> None:
        """Release on the releasing thread: the step that finishes a request (its last token) waits for no call. Its
        committed blocks were cached when committed; a later open of the prompt locks them itself."""
        del self.requests[tracked.req_id]
        if tracked.seq_id is not None:
            self._releases.submit(self._release_now, tracked.seq_id)

    def _release_now(self, seq_id: int) -> None:
        try:
            self.client.release(seq_id, cache=True)  # its committed blocks stay cached
        except Exception as e:
            log.warning("radixkv release failed (the session's lease ends it): %s", e)

    def close(self) -> None:
        """Wait for the releases in flight (before the client closes)."""
        self._releases.shutdown(wait=True)
