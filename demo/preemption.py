"""Preemption in the demo: which request gives its blocks back when a step's appends do not fit, and how.

A request of one sequence is preempted by recompute, vLLM's default: the core publishes its computed
blocks to the tree and keeps its tokens under its sequence id; on resume it re-matches what is still
cached and hands back the slots of the rest, which the worker prefills again. A request of several
sequences (parallel samples, beams) is not preempted: recomputing it would mean redoing its forks. The
victim is the latest arrival among the requests that can be.

A preempted request keeps its sequence id, and its sequence keeps the token it had sampled but not
appended. It resumes first in line; at the end of that step (after the worker has prefilled what the
cache no longer held) that token is appended, and it decodes from the next step on, as if nothing had
happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from radixkv.client import RadixKVClient
from radixkv.errors import OutOfBlocks

RECOMPUTE = "recompute"
T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class Parked:
    """A preempted request's sequences, in the request's order, and the token each appends on resume."""

    mode: str
    seq_ids: list[int]
    pending_tokens: list[int]
    num_resumed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Refill:
    """A resumed sequence's tokens the cache no longer holds: the worker prefills them again."""

    index: int  # of the sequence, in the request's order
    num_cached_tokens: int
    slots: npt.NDArray[np.int64]  # [num_tokens - num_cached_tokens]


class Preemptible(Protocol):
    parked: Parked | None  # while preempted


R = TypeVar("R", bound=Preemptible)


class Preemption:
    """Chooses victims, and preempts and resumes them through the client."""

    def __init__(self, client: RadixKVClient) -> None:
        self.client = client
        self.last_refusal: OutOfBlocks | None = None  # why the latest resume that did not fit was refused

    def mode_for(self, num_seqs: int) -> str | None:
        """Recompute one sequence; None for several: they are not preempted."""
        return RECOMPUTE if num_seqs == 1 else None

    def choose(self, candidates: Sequence[tuple[T, int]]) -> T | None:
        """The latest of `candidates` (request, its number of sequences; in arrival order) that can be
        preempted, or None."""
        return next((request for request, n in reversed(candidates) if self.mode_for(n) is not None), None)

    def preempt(self, seq_ids: list[int], num_written: list[int], pending_tokens: list[int]) -> Parked:
        """Preempt a request's sequences, each of which holds `num_written[i]` tokens, all written by the worker."""
        mode = self.mode_for(len(seq_ids))
        assert mode is not None, "the orchestrator preempts only what `choose` chose"
        self.client.commit(seq_ids, num_written)  # recompute publishes only written K/V
        self.client.preempt(seq_ids, mode)
        return Parked(mode, list(seq_ids), list(pending_tokens))

    def resume_waiting(self, waiting: list[R], anything_running: bool) -> tuple[list[R], list[tuple[R, Refill]]]:
        """Resume the preempted requests of `waiting` in order while they fit, removing them from it.

        Returns them and what the worker prefills again for them.

        Raises:
            OutOfBlocks: nothing runs, and still the first preempted request cannot come back.
        """
        resumed: list[R] = []
        refills: list[tuple[R, Refill]] = []
        for request in [r for r in waiting if r.parked is not None]:
            assert request.parked is not None
            back = self._resume(request.parked)
            refills += [(request, refill) for refill in back]
            if request.parked.num_resumed < len(request.parked.seq_ids):
                if not anything_running and not resumed and not back:
                    assert self.last_refusal is not None
                    raise self.last_refusal
                break
            waiting.remove(request)
            resumed.append(request)
        return resumed, refills

    def _resume(self, parked: Parked) -> list[Refill]:
        """Bring back as many of the request's sequences as fit now; what each needs prefilled again."""
        refills: list[Refill] = []
        while parked.num_resumed < len(parked.seq_ids):
            try:
                resumed = self.client.resume(parked.seq_ids[parked.num_resumed])
            except OutOfBlocks as e:
                self.last_refusal = e
                break
            slots = np.asarray(resumed.slots, dtype=np.int64)
            if len(slots):
                refills.append(Refill(parked.num_resumed, resumed.num_cached_tokens, slots))
            parked.num_resumed += 1
        return refills
