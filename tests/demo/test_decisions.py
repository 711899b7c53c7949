"""Sampling and beam-search decisions, apart from any cache."""

from __future__ import annotations

import pytest
import torch

from radixkv.demo import beam_search
from radixkv.demo.beam_search import Hypothesis
from radixkv.demo.sampling import SamplingParams, sample_token


def test_greedy_and_tiny_top_p_take_the_argmax() -> None:
    logprobs = torch.log_softmax(torch.tensor([0.1, 3.0, 2.9, -1.0]), dim=-1)
    generator = torch.Generator().manual_seed(0)
    assert sample_token(logprobs, SamplingParams(), generator) == 1
    assert {sample_token(logprobs, SamplingParams(temperature=1.0, top_p=1e-3), generator) for _ in range(50)} == {1}


def test_top_p_keeps_the_nucleus_and_the_seed_repeats() -> None:
    logprobs = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    draws = [sample_token(logprobs, params, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert len(set(draws)) == 1  # one seed, one draw
    generator = torch.Generator().manual_seed(3)
    assert {sample_token(logprobs, params, generator) for _ in range(200)} == {0, 1}  # 0.5 + 0.3 reach 0.7


@pytest.mark.parametrize("bad", [{"n": 0}, {"temperature": -1.0}, {"top_p": 0.0}])
def test_sampling_params_refuse_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_select_ranks_all_extensions_and_finishes_eos_in_the_top_width() -> None:
    scores = torch.tensor([0.0, -1.0])
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]))  # token 1 is EOS
    continuing, finished = beam_search.select(scores, logprobs, 2, eos_token_ids=(1,))
    # Ranked (parent, token): (0, 0) -0.51, (1, 0) -1.11, (0, 1) -1.20 EOS, (0, 2) -2.30, (1, 1) -4.00 EOS, ...
    assert [(c.parent, c.token_id) for c in continuing] == [(0, 0), (1, 0)]
    assert finished == []  # the EOS extension ranked 3rd: outside the top 2
    continuing, finished = beam_search.select(scores, logprobs, 3, eos_token_ids=(1,))
    assert [(c.parent, c.token_id) for c in finished] == [(0, 1)]
    assert [(c.parent, c.token_id) for c in continuing] == [(0, 0), (1, 0), (0, 2)]
    assert continuing[1].score == pytest.approx(-1.0 + torch.log(torch.tensor(0.9)).item())


def test_best_normalises_by_length() -> None:
    short, long = Hypothesis((5,), -1.0), Hypothesis((5, 6, 7, 8), -2.0)
    assert beam_search.best([short, long], 1) == [long]
    assert beam_search.best([short, long], 2, length_penalty=0.0) == [short, long]
