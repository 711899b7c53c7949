"""Beam search decisions, apart from where the beams' K/V live.

`select` picks a step's survivors from the live beams' next-token log-probabilities; the caller
carries them out on its own cache (forks and releases through radixkv, or copies of dense caches in
the reference), so both paths make exactly the same choices from the same numbers.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    parent: int  # index of the live beam it extends
    token_id: int
    score: float  # cumulative log-probability of the generated tokens, this one included


@dataclasses.dataclass(frozen=True, slots=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens (an ending EOS included)
    score: float  # cumulative log-probability

    def normalized_score(self, length_penalty: float) -> float:
        return self.score / len(self.token_ids) ** length_penalty


def select(
    scores: torch.Tensor, logprobs: torch.Tensor, width: int, eos_token_ids: tuple[int, ...]
) -> tuple[list[Candidate], list[Candidate]]:
    """The next step's `width` live beams, and the candidates that ended with EOS among the best `width`.

    As Hugging Face does: rank the best `2 * width` extensions of all beams; an EOS among the top
    `width` ranks finishes a hypothesis, the rest fill the live beams in rank order.

    Args:
        scores: fp32 `[num_beams]` cumulative log-probabilities of the live beams.
        logprobs: fp32 `[num_beams, vocab_size]` next-token log-probabilities.

    Returns:
        (continuing, finished), each in rank order; `continuing` has `width` entries unless the
        vocabulary runs short.
    """
    num_beams, vocab_size = logprobs.shape
    totals = (scores[:, None] + logprobs).flatten()  # [num_beams * vocab_size]
    top_scores, top_index = totals.topk(min(2 * width, totals.numel()))  # [2 * width] each
    continuing: list[Candidate] = []
    finished: list[Candidate] = []
    for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist(), strict=True)):
        candidate = Candidate(index // vocab_size, index % vocab_size, score)
        if candidate.token_id in eos_token_ids:
            if rank < width:
                finished.append(candidate)
        elif len(continuing) < width:
            continuing.append(candidate)
    return continuing, finished


def best(hypotheses: list[Hypothesis], width: int, length_penalty: float = 1.0) -> list[Hypothesis]:
    """The `width` best hypotheses by length-normalised score, best first (ties keep their order)."""
    return sorted(hypotheses, key=lambda h: -h.normalized_score(length_penalty))[:width]
