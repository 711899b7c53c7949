"""What the orchestrator takes and gives: a request's spec, its result, a record of each scheduler step, and
the error that says the pool is too small for a request."""

from __future__ import annotations

import dataclasses

from radixkv.demo.sampling import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    """One request: `n` samples (`sampling`), or beam search when `beam_width` > 0.

    With `follows`, this is the next turn of that request's conversation: its prompt is the earlier
    prompt, the earlier request's first output (less an ending EOS, which the continuation restates
    as a chat template does), then `prompt`. It arrives when the earlier request finishes.
    """

    name: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    beam_width: int = 0
    follows: str | None = None


@dataclasses.dataclass(slots=True, kw_only=True)
class RequestResult:
    name: str
    prompt: list[int]
    num_cached_tokens: int  # prompt tokens the server already held (prefix hit)
    outputs: list[list[int]]  # per sample, or per hypothesis best first
    scores: list[float]  # beam search: each hypothesis' cumulative log-probability
    peak_blocks: int = 0  # most distinct blocks its sequences held at once
    num_cow_copies: int = 0
    num_generated_tokens: int = 0
    seconds: float = 0.0  # from arrival to the last token
    ttft: float = 0.0  # seconds from arrival to the first token
    num_preemptions: int = 0  # by either mode
    num_swaps: int = 0  # of those, by swap (its blocks went to the host tier and came back)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """The state after one step's appends: what the next model step reads, charged three ways."""

    step: int
    num_prefills: int
    num_cached_tokens: int  # of the prompts admitted this step
    num_prefill_tokens: int  # computed this step: the admitted prompts' uncached tails
    num_decodes: int
    num_live_seqs: int
    num_waiting: int  # arrived requests not yet admitted (preempted ones included)
    num_preempted: int  # requests preempted this step
    num_copies: int
    num_offloaded_blocks: int  # device -> host this step: swap-outs, evicted prefixes written back
    num_loaded_blocks: int  # host -> device this step: swap-ins, host hits loaded back
    seconds: float  # the step's wall time: scheduling, the model, the appends
    blocks_radixkv: int  # the server's blocks in use: shared prefixes and forks count once
    blocks_unshared: int  # every live sequence its own blocks
    blocks_contiguous: float  # every live sequence a slab of prompt + max_new_tokens, in blocks


class PoolTooSmall(Exception):
    """No schedule helps: with nothing else running, the pool still cannot hold what `request` needs next.

    `host_tier_helps`: a host tier would let it be preempted (a request of several sequences is preempted
    only by swap); otherwise only a larger pool does.
    """

    def __init__(self, request: str, why: str, *, host_tier_helps: bool = False) -> None:
        super().__init__(f"request {request!r} {why}")
        self.request = request
        self.host_tier_helps = host_tier_helps
