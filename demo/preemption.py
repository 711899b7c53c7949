"""Preemption in the demo: which request gives its blocks back when a step's appends do not fit, and how.

The mode follows vLLM's rule. A request of one sequence is preempted by recompute: the core publishes
its computed blocks to the tree, and on resume it re-matches what is still cached and hands back the
slots of the rest for the worker to prefill again. A request of several sequences (parallel samples,
beams) is preempted by swap: the blocks only its sequences hold move to the host tier and come back on
resume, since recomputing it would mean redoing its forks. Without a host tier such a request is not
preempted. The victim is the latest arrival among the requests that can be, never one resumed in the
same step (it would come and go forever): a pool that cannot hold that one and its next tokens is too
small for it. A request comes back whole or not at all, so no half-resumed request holds blocks.

A preempted request keeps its sequence ids, and each sequence keeps the token it had sampled but not
appended. It resumes first in line; at the end of that step (after the worker has loaded its blocks
back, or prefilled what the cache no longer held) those tokens are appended, and it decodes from the
next step on, as if nothing had happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from radixkv.client import RadixKVClient
from radixkv.demo.worker import Pairs, as_pairs
from radixkv.errors import OutOfBlocks

SWAP, RECOMPUTE = "swap", "recompute"
T = TypeVar("T")


@dataclasses.dataclass(slots=True, kw_only=True)
class Parked:
    """A preempted request's sequences, in the request's order, and the token each appends on resume."""

    mode: str
    seq_ids: list[int]
    pending_tokens: list[int]
    num_swapped_blocks: int = 0  # what a swap moved to the host tier: at least what resuming it takes


@dataclasses.dataclass(frozen=True, slots=True)
class Refill:
    """A resumed sequence's tokens the cache no longer holds: the worker prefills them again."""

    index: int  # of the sequence, in the request's order
    num_cached_tokens: int
    slots: npt.NDArray[np.int64]  # [num_tokens - num_cached_tokens]


@dataclasses.dataclass(slots=True)
class Resumed:
    """What resuming did this step: per resume, the block moves for the worker (swap-ins, and offloads of what
    it evicted to make room), and the refills (recompute)."""

    transfers: list[tuple[Pairs, Pairs]]  # (offloads, loads)
    refills: list[Refill]
    complete: bool  # every sequence of the request is back (else none is)


class Preemptible(Protocol):
    parked: Parked | None  # while preempted


R = TypeVar("R", bound=Preemptible)


class Preemption:
    """Chooses victims and modes, and preempts and resumes them through the client."""

    def __init__(self, client: RadixKVClient, has_host_tier: bool) -> None:
        self.client, self.has_host_tier = client, has_host_tier
        self.last_refusal: OutOfBlocks | None = None  # why the latest resume that did not fit was refused

    def mode_for(self, num_seqs: int) -> str | None:
        """Recompute one sequence, swap several (None without a host tier: they are not preempted)."""
        if num_seqs == 1:
            return RECOMPUTE
        return SWAP if self.has_host_tier else None

    def choose(self, candidates: Sequence[tuple[T, int]]) -> T | None:
        """The latest of `candidates` (request, its number of sequences; in arrival order) that can be
        preempted, or None."""
        return next((request for request, n in reversed(candidates) if self.mode_for(n) is not None), None)

    def preempt(self, seq_ids: list[int], num_written: list[int], pending_tokens: list[int]) -> tuple[Parked, Pairs]:
        """Preempt a request's sequences, each of which holds `num_written[i]` tokens, all written by the worker.

        Returns the parked record and the offloads `(device_block, host_block)` the worker applies first
        in the next step, before anything writes into the freed blocks.
        """
        mode = self.mode_for(len(seq_ids))
        assert mode is not None, "the orchestrator preempts only what `choose` chose"
        self.client.commit(seq_ids, num_written)  # recompute publishes, and swap keeps, only written K/V
        result = self.client.preempt(seq_ids, mode)
        offloads = as_pairs(result.offloads)
        return Parked(
            mode=mode,
            seq_ids=list(seq_ids),
            pending_tokens=list(pending_tokens),
            num_swapped_blocks=len(offloads) if mode == SWAP else 0,
        ), offloads

    def resume(self, parked: Parked) -> Resumed:
        """Bring the request's sequences back, all or none: when one does not fit, those already back are
        swapped out again (their moves follow the resumes' in `transfers`, so the worker loads them first)."""
        transfers: list[tuple[Pairs, Pairs]] = []
        refills: list[Refill] = []
        for index, seq_id in enumerate(parked.seq_ids):
            try:
                resumed = self.client.resume(seq_id)
            except OutOfBlocks as e:
                self.last_refusal = e
                if index:
                    undone = self.client.preempt(parked.seq_ids[:index], parked.mode)
                    transfers.append((as_pairs(undone.offloads), []))
                return Resumed(transfers, [], complete=False)
            transfers.append((as_pairs(resumed.offloads), as_pairs(resumed.loads)))
            slots = np.asarray(resumed.slots, dtype=np.int64)
            if len(slots):
                refills.append(Refill(index, resumed.num_cached_tokens, slots))
        return Resumed(transfers, refills, complete=True)

    def resume_waiting(
        self, waiting: list[R], anything_running: bool
    ) -> tuple[list[R], list[tuple[Pairs, Pairs]], list[tuple[R, Refill]]]:
        """Resume the preempted requests of `waiting` in order while they fit, removing those back whole from it.

        Returns them, the block moves for the worker's step (per resume) and what it prefills again (recompute).

        Raises:
            OutOfBlocks: nothing runs, and still the first preempted request cannot come back at all.
        """
        resumed: list[R] = []
        transfers: list[tuple[Pairs, Pairs]] = []
        refills: list[tuple[R, Refill]] = []
        stats = self.client.stats()
        available = stats.num_blocks_free + stats.num_blocks_evictable - stats.num_blocks_reserved
        for request in [r for r in waiting if r.parked is not None]:
            assert request.parked is not None
            if anything_running and request.parked.num_swapped_blocks > available:
                break  # it cannot come back whole yet: do not swap it in and out again
            outcome = self.resume(request.parked)
            transfers += outcome.transfers
            refills += [(request, refill) for refill in outcome.refills]
            if not outcome.complete:
                if not anything_running and not resumed:
                    assert self.last_refusal is not None
                    raise self.last_refusal
                break
            waiting.remove(request)
            resumed.append(request)
            available -= request.parked.num_swapped_blocks
        return resumed, transfers, refills
