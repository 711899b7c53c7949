"""The orchestrator: decides what every sequence does, through the radixkv client alone.

Per scheduler step it admits waiting requests under a token budget (continuous batching, see
`admission`; open: the server matches the longest cached prefix), asks the worker to prefill the
admitted prompt tails and decode every live sequence's newest token, then chooses next tokens:
parallel samples fork from the prompt, beams fork where several survivors extend one beam and are
released where none does, finished sequences are released with caching. Its appends come back with
slots and copy-on-write pairs, which travel to the worker in the next step. When the pool cannot hold
a step's appends, a request is preempted (see `preemption`: by recompute, or by swap to the host
tier) and waits first in line to resume under the same sequence ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from radixkv.client import RadixKVClient
from radixkv.demo import beam_search
from radixkv.demo.admission import Admission
from radixkv.demo.beam_search import Hypothesis
from radixkv.demo.live_request import LiveRequest, LiveSeq
from radixkv.demo.preemption import SWAP, Preemption, Refill
from radixkv.demo.records import PoolTooSmall, RequestResult, RequestSpec, StepRecord
from radixkv.demo.sampling import sample_token
from radixkv.demo.worker import DecodeInput, Pairs, PrefillInput, Worker, WorkerStep, as_pairs
from radixkv.errors import OutOfBlocks

__all__ = ["Orchestrator", "PoolTooSmall", "RequestResult", "RequestSpec", "StepRecord"]


class Orchestrator:
    """Runs requests to completion; `on_step` sees each step's record (the demo prints it)."""

    def __init__(
        self,
        client: RadixKVClient,
        worker: Worker,
        *,
        eos_token_ids: tuple[int, ...],
        namespace: str = "default",
        on_step: Callable[[StepRecord], None] | None = None,
        max_batch_tokens: int = 512,
        prefix_caching: bool = True,
    ) -> None:
        self.client, self.worker, self.eos = client, worker, eos_token_ids
        self.namespace, self.on_step = namespace, on_step
        self.block_size = client.get_pool().layout.block_size
        # Without prefix caching nothing is published to the tree (forks still share within a request).
        self.prefix_caching = prefix_caching
        self.admission = Admission(max_batch_tokens, self.block_size, defer_shared=prefix_caching)
        self.preemption = Preemption(client, has_host_tier=worker.host_data is not None)
        self.steps: list[StepRecord] = []
        self._waiting: list[LiveRequest] = []
        self._live: list[LiveRequest] = []
        self._to_cache: list[int] = []  # sequences to publish once this step's appends commit their prompt
        self._num_preempted = 0  # in the current step

    def run(self, specs: list[RequestSpec]) -> list[RequestResult]:
        """Run every request to completion: all arrive now, a follow-up when its turn before finishes.

        Raises:
            ValueError: a `follows` that names no earlier request (it could never be admitted).
            PoolTooSmall: the pool cannot hold one request's next step even with nothing else running.
        """
        for i, spec in enumerate(specs):
            if spec.follows is not None and spec.follows not in {s.name for s in specs[:i]}:
                raise ValueError(f"request {spec.name!r} follows {spec.follows!r}, which is not an earlier request")
        later = [s for s in specs if s.follows is not None]
        self._waiting = [LiveRequest.arrive(s, []) for s in specs if s.follows is None]
        self._live = []
        done: dict[str, RequestResult] = {}
        copies: list[tuple[int, int]] = []
        offloads: list[tuple[int, int]] = []
        while self._waiting or self._live:
            started = time.perf_counter()
            self._num_preempted = 0
            try:
                resumed, transfers, refills = self.preemption.resume_waiting(self._waiting, bool(self._live))
            except OutOfBlocks as e:
                name = next(r.spec.name for r in self._waiting if r.parked)
                raise PoolTooSmall(name, f"cannot come back from preemption with nothing else running ({e})") from e
            num_resumed_seqs = sum(len(r.seqs) for r in resumed)
            admitted = self._admit(num_resumed_seqs, transfers) if not any(r.parked for r in self._waiting) else []
            num_prefill_tokens = sum(len(r.context) - r.num_cached_tokens for r in admitted)
            num_prefill_tokens += sum(len(r.seqs[f.index].token_ids) - f.num_cached_tokens for r, f in refills)
            decoding = [(r, s) for r in self._live for s in r.seqs]
            prefills = [self._prefill_input(r) for r in admitted] + [self._refill_input(r, f) for r, f in refills]
            step = WorkerStep(
                copies=copies,
                prefills=prefills,
                decodes=[self._decode_input(s) for _, s in decoding],
                offloads=offloads,
                transfers=transfers,
            )
            out = self.worker.execute(step)
            num_moved = step.num_offloaded_blocks, step.num_loaded_blocks
            appends: list[tuple[LiveRequest, LiveSeq, int]] = []
            for request, logprobs in zip(admitted, out.prefill_logprobs[: len(admitted)], strict=True):
                if not request.result.outputs[0]:
                    request.result.ttft = time.perf_counter() - request.arrived
                appends += self._after_prefill(request, logprobs)
            rows = iter(out.decode_logprobs)
            for request in list(self._live):
                logprobs = torch.stack([next(rows) for _ in request.seqs])  # [num_seqs, vocab_size]
                appends += self._after_decode(request, logprobs)
            for request in resumed:  # back whole: the tokens sampled before the preemption are appended now
                assert request.parked is not None
                appends += [(request, s, t) for s, t in zip(request.seqs, request.parked.pending_tokens, strict=True)]
                request.parked = None
            self._live += admitted + resumed
            copies, offloads = self._append(appends, resumed)
            for request in self._live:
                if not request.seqs and request.parked is None:
                    request.result.seconds = time.perf_counter() - request.arrived
                    done[request.spec.name] = request.result
                    self._waiting += [
                        LiveRequest.arrive(s, request.result.prompt + self._answer(request))
                        for s in later
                        if s.follows == request.spec.name
                    ]
            self._live = [r for r in self._live if r.seqs]
            self._record(
                admitted, num_prefill_tokens, len(decoding), len(copies), num_moved, time.perf_counter() - started
            )
        return [done[s.name] for s in specs]

    # -- admission -------------------------------------------------------------------------------

    def _answer(self, request: LiveRequest) -> list[int]:
        """The first output as the next turn's prompt carries it: an ending EOS is left to the continuation."""
        output = request.result.outputs[0]
        return output[:-1] if output and output[-1] in self.eos else list(output)

    def _admit(self, num_resumed_seqs: int, transfers: list[tuple[Pairs, Pairs]]) -> list[LiveRequest]:
        """Open the requests the admission policy chooses; a request the pool cannot open yet keeps waiting.

        `num_resumed_seqs`: sequences resumed this step, which append (and so need headroom) like decodes.
        Each open's block moves (a host hit loaded back, what it evicted written back) join `transfers`.
        """
        stats = self.client.stats()
        num_decodes = sum(len(r.seqs) for r in self._live) + num_resumed_seqs
        chosen = self.admission.choose(
            [r.context for r in self._waiting],
            self.client,
            self.namespace,
            num_decodes,
            stats.num_blocks_free + stats.num_blocks_evictable,
        )
        admitted: list[LiveRequest] = []
        for request in [self._waiting[i] for i in chosen]:
            try:
                opened = self.client.open(request.context, self.namespace)
            except OutOfBlocks as e:
                if admitted or self._live or num_resumed_seqs:
                    break  # blocks come back as live requests finish
                why = (
                    f"needs {e.needed} blocks for its prompt of {len(request.context)} tokens; the pool holds {e.free}"
                )
                raise PoolTooSmall(request.spec.name, f"{why} (a host tier holds no prompt being computed)") from e
            self._waiting.remove(request)
            transfers.append((as_pairs(opened.offloads), as_pairs(opened.loads)))
            if not request.result.outputs[0]:
                request.result.num_cached_tokens = opened.num_cached_tokens
            request.num_cached_tokens = opened.num_cached_tokens
            request.seqs = [LiveSeq(seq_id=opened.seq_id, index=0, token_ids=list(request.context))]
            request.prefill_slots = np.asarray(opened.slots, dtype=np.int64)
            request.result.peak_blocks = max(request.result.peak_blocks, len(opened.block_table))
            admitted.append(request)
        return admitted

    def _refill_input(self, request: LiveRequest, refill: Refill) -> PrefillInput:
        """A resumed sequence's tokens the cache lost, computed again (the logits are not needed)."""
        seq = request.seqs[refill.index]
        cached = refill.num_cached_tokens
        assert len(refill.slots) == len(seq.token_ids) - cached, "resume hands out a slot per token to recompute"
        table = self.client.block_table(seq.seq_id)
        return PrefillInput(
            token_ids=seq.token_ids[cached:], num_cached_tokens=cached, slots=refill.slots, block_table=table
        )

    def _prefill_input(self, request: LiveRequest) -> PrefillInput:
        seq = request.seqs[0]
        cached = request.num_cached_tokens
        table = self.client.block_table(seq.seq_id)
        return PrefillInput(
            token_ids=seq.token_ids[cached:], num_cached_tokens=cached, slots=request.prefill_slots, block_table=table
        )

    def _decode_input(self, seq: LiveSeq) -> DecodeInput:
        table = self.client.block_table(seq.seq_id)
        return DecodeInput(
            token_id=seq.token_ids[-1], position=len(seq.token_ids) - 1, slot=seq.slot, block_table=table
        )

    # -- choosing next tokens --------------------------------------------------------------------

    def _after_prefill(self, request: LiveRequest, logprobs: torch.Tensor) -> list[tuple[LiveRequest, LiveSeq, int]]:
        # logprobs: [vocab_size], after the prompt's last token
        if request.spec.beam_width > 0:
            return self._beam_step(request, logprobs[None])
        parent = request.seqs[0]
        outputs, n = request.result.outputs, request.spec.sampling.n
        tokens = [sample_token(logprobs, request.spec.sampling, request.generator) for _ in range(n)]
        request.result.num_generated_tokens += len(tokens)
        request.seqs = []
        going: list[tuple[int, int]] = []  # (sample index, token) of samples that go on
        for index, token in enumerate(tokens):
            outputs[index].append(token)
            if token in self.eos or len(outputs[index]) == request.spec.max_new_tokens:
                continue
            going.append((index, token))
        if not going:
            self._release_written([parent])
            return []
        # The samples share the whole prompt: forks hold its blocks, the partial last one copied on first write.
        children = self.client.fork(parent.seq_id, len(going) - 1) if len(going) > 1 else []
        if not children and self.prefix_caching:
            self._to_cache.append(parent.seq_id)  # so requests admitted while this one runs hit its prompt
        appends = []
        for (index, token), seq_id in zip(going, [parent.seq_id, *children], strict=True):
            seq = LiveSeq(seq_id=seq_id, index=index, token_ids=list(parent.token_ids))
            request.seqs.append(seq)
            appends.append((request, seq, token))
        return appends

    def _after_decode(self, request: LiveRequest, logprobs: torch.Tensor) -> list[tuple[LiveRequest, LiveSeq, int]]:
        # logprobs: [num_seqs, vocab_size], one row per live sequence of the request
        if request.spec.beam_width > 0:
            return self._beam_step(request, logprobs)
        appends, going, finished = [], [], []
        for seq, row in zip(request.seqs, logprobs, strict=True):
            token = sample_token(row, request.spec.sampling, request.generator)
            request.result.outputs[seq.index].append(token)
            request.result.num_generated_tokens += 1
            if token in self.eos or len(request.result.outputs[seq.index]) == request.spec.max_new_tokens:
                finished.append(seq)  # its last token is never computed, so never appended
            else:
                going.append(seq)
                appends.append((request, seq, token))
        if finished:
            self._release_written(finished)
        request.seqs = going
        return appends

    def _beam_step(self, request: LiveRequest, logprobs: torch.Tensor) -> list[tuple[LiveRequest, LiveSeq, int]]:
        # logprobs: [num_beams, vocab_size]
        beams, width = request.seqs, request.spec.beam_width
        scores = torch.tensor([b.score for b in beams])  # [num_beams]
        continuing, finished = beam_search.select(scores, logprobs, width, self.eos)
        request.result.num_generated_tokens += len(continuing) + len(finished)
        generated = [tuple(b.token_ids[request.num_prompt :]) for b in beams]
        request.hypotheses += [Hypothesis(generated[c.parent] + (c.token_id,), c.score) for c in finished]
        if len(generated[0]) + 1 == request.spec.max_new_tokens or not continuing:
            request.hypotheses += [Hypothesis(generated[c.parent] + (c.token_id,), c.score) for c in continuing]
            self._release_written(beams)
            best = beam_search.best(request.hypotheses, width)
            request.result.outputs = [list(h.token_ids) for h in best]
            request.result.scores = [h.score for h in best]
            request.seqs = []
            return []
        counts = [0] * len(beams)
        for c in continuing:
            counts[c.parent] += 1
        pruned = [b.seq_id for b, n in zip(beams, counts, strict=True) if n == 0]
        if pruned:
            self.client.release_many(pruned, cache=False)  # a pruned beam's tail is of no use to anyone
        # Every fork before any append: a child must share its parent's blocks as they are now.
        forks = {
            i: iter(self.client.fork(b.seq_id, n - 1))
            for i, (b, n) in enumerate(zip(beams, counts, strict=True))
            if n > 1
        }
        seen: set[int] = set()
        appends = []
        request.seqs = []
        for c in continuing:
            parent = beams[c.parent]
            seq_id = parent.seq_id if c.parent not in seen else next(forks[c.parent])
            seen.add(c.parent)
            seq = LiveSeq(seq_id=seq_id, index=0, token_ids=list(parent.token_ids), score=c.score)
            request.seqs.append(seq)
            appends.append((request, seq, c.token_id))
        return appends

    # -- appends and accounting ------------------------------------------------------------------

    def _append(
        self, appends: list[tuple[LiveRequest, LiveSeq, int]], resumed: list[LiveRequest]
    ) -> tuple[Pairs, Pairs]:
        """One batched append for the whole step; returns the copy-on-write pairs and the offloads (of the
        requests it preempted by swap, and of prefixes it evicted to the host tier) for the worker's next step.

        When the pool runs out, preempts requests (latest first) until the rest fits; never one `resumed` in
        this step, which would come and go forever: a pool that cannot hold it and its next tokens is too small.
        """
        offloads: list[tuple[int, int]] = []
        while True:
            try:
                results = (
                    self.client.append_many([(seq.seq_id, [token]) for _, seq, token in appends]) if appends else []
                )
                break
            except OutOfBlocks as e:
                candidates = [a for a in appends if a[0] not in resumed]
                victim = self._preempt_one(candidates, offloads)
                if victim is None:  # only requests just resumed, or of several sequences without a host tier
                    why = "holds several sequences (samples, beams), which only a swap to a host tier preempts"
                    why = f"{why}, and this step's tokens do not fit" if candidates else "came back and does not fit"
                    name = (candidates or appends)[-1][0].spec.name
                    raise PoolTooSmall(name, f"{why} ({e})", host_tier_helps=bool(candidates)) from e
                appends = [a for a in appends if a[0] is not victim]
        if results:  # the batch's offloads come on its first row
            offloads += as_pairs(results[0].batch.offloads)
        copies = []
        for (request, seq, token), result in zip(appends, results, strict=True):
            seq.token_ids.append(token)
            seq.slot = int(np.asarray(result.slots)[0])
            copies += result.copies
            request.result.num_cow_copies += len(result.copies)
        live = {s.seq_id for r in self._live for s in r.seqs}
        for seq_id in self._to_cache:
            if seq_id in live:  # its first append committed the prompt's K/V
                self.client.cache(seq_id)
        self._to_cache = []
        return copies, offloads

    def _release_written(self, seqs: list[LiveSeq]) -> None:
        """Release sequences whose every token the worker has written; with prefix caching, commit says so
        first, since only blocks below a sequence's computed watermark are ever cached."""
        seq_ids = [s.seq_id for s in seqs]
        if self.prefix_caching:
            self.client.commit(seq_ids, [len(s.token_ids) for s in seqs])
        self.client.release_many(seq_ids, cache=self.prefix_caching)

    def _preempt_one(
        self, appends: list[tuple[LiveRequest, LiveSeq, int]], offloads: list[tuple[int, int]]
    ) -> LiveRequest | None:
        """Preempt the latest request of this step's appends that `preemption` allows; None when none is.

        Its sequences' K/V up to their newest appended token is written; the token each sampled this
        step waits with it, appended when it resumes. Its offloads join `offloads`.
        """
        pending = {id(seq): token for _, seq, token in appends}
        appending = {id(r): r for r, _, _ in appends}
        candidates = sorted(appending.values(), key=lambda r: r.arrived)
        victim = self.preemption.choose([(r, len(r.seqs)) for r in candidates])
        if victim is None:
            return None
        seqs = victim.seqs
        victim.parked, moved = self.preemption.preempt(
            [s.seq_id for s in seqs], [len(s.token_ids) for s in seqs], [pending[id(s)] for s in seqs]
        )
        offloads += moved
        victim.result.num_preemptions += 1
        victim.result.num_swaps += victim.parked.mode == SWAP
        self._num_preempted += 1
        self._live.remove(victim)
        self._waiting.insert(0, victim)
        return victim

    def _record(
        self,
        admitted: list[LiveRequest],
        num_prefill_tokens: int,
        num_decodes: int,
        num_copies: int,
        num_moved: tuple[int, int],
        seconds: float,
    ) -> None:
        bs = self.block_size
        seqs = [(r, s) for r in self._live for s in r.seqs]
        for request in self._live:
            held = {b for s in request.seqs for b in self.client.block_table(s.seq_id)}
            request.result.peak_blocks = max(request.result.peak_blocks, len(held))
        record = StepRecord(
            step=len(self.steps),
            num_prefills=len(admitted),
            num_cached_tokens=sum(r.num_cached_tokens for r in admitted),
            num_prefill_tokens=num_prefill_tokens,
            num_decodes=num_decodes,
            num_live_seqs=len(seqs),
            num_waiting=len(self._waiting),
            num_preempted=self._num_preempted,
            num_copies=num_copies,
            num_offloaded_blocks=num_moved[0],
            num_loaded_blocks=num_moved[1],
            seconds=seconds,
            blocks_radixkv=self.client.stats().num_blocks_in_use,
            blocks_unshared=sum(-(-len(s.token_ids) // bs) for _, s in seqs),
            blocks_contiguous=sum(r.num_prompt + r.spec.max_new_tokens for r, _ in seqs) / bs,
        )
        self.steps.append(record)
        if self.on_step is not None:
            self.on_step(record)
