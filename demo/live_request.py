"""A request while the orchestrator runs it: its sequences, their tokens, and where it stands."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import numpy.typing as npt
import torch

from radixkv.demo.beam_search import Hypothesis
from radixkv.demo.preemption import Parked
from radixkv.demo.records import RequestResult, RequestSpec


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class LiveSeq:
    seq_id: int
    index: int  # sample index (sampling) within its request
    token_ids: list[int]  # prompt and generated tokens, the newest one (not yet computed) included
    score: float = 0.0  # beam search: cumulative log-probability of the generated tokens
    slot: int = -1  # where the newest token's K/V go


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class LiveRequest:
    spec: RequestSpec
    result: RequestResult
    generator: torch.Generator
    seqs: list[LiveSeq]
    hypotheses: list[Hypothesis]
    arrived: float
    context: list[int]  # what it opens: the prompt (a preempted request resumes instead)
    num_cached_tokens: int = 0  # of `context`, at its latest open
    prefill_slots: npt.NDArray[np.int64] = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    parked: Parked | None = None  # while preempted

    @property
    def num_prompt(self) -> int:
        return len(self.result.prompt)

    @classmethod
    def arrive(cls, spec: RequestSpec, earlier_turn: list[int]) -> LiveRequest:
        """`spec` arriving now; a next turn's prompt starts with `earlier_turn` (see `RequestSpec.follows`)."""
        prompt = earlier_turn + list(spec.prompt)
        result = RequestResult(
            name=spec.name, prompt=prompt, num_cached_tokens=0, outputs=[[] for _ in range(spec.sampling.n)], scores=[]
        )
        generator = torch.Generator().manual_seed(spec.sampling.seed)
        return cls(
            spec=spec,
            result=result,
            generator=generator,
            seqs=[],
            hypotheses=[],
            arrived=time.perf_counter(),
            context=list(prompt),
        )
