"""The README's continuous-batching example, run as it is: a real server, the orchestrator here, the worker in
its own process, and every attention the worker computes checked against its sequence's dense K/V."""

from __future__ import annotations

from radixkv.demo.continuous_batching import LAYOUT, SYSTEM_PROMPT, run_example
from radixkv.demo.server_process import ServerProcess


def test_the_loop_shares_preempts_and_hits_a_second_turn():
    with ServerProcess(LAYOUT) as address:
        report, requests = run_example(address)
    assert report.max_attention_error < 1e-4, "the worker read K/V that its tokens did not produce"
    first, *siblings, second_turn = requests
    assert report.hits[first.name] == 0
    for r in siblings:  # admitted once the first was committed and cached
        assert report.hits[r.name] == len(SYSTEM_PROMPT), r.name
    assert report.num_preempted >= 1, "the pool is sized so that decoding runs out of blocks"
    assert sorted(report.finished) == sorted(r.name for r in requests)
    assert all(len(r.output) == r.max_new_tokens for r in requests)
    previous = next(r for r in requests if second_turn.name == f"{r.name}-turn2")
    written = len(previous.token_ids) - 1  # its newest token was sampled, never appended
    assert report.hits[second_turn.name] == written // LAYOUT.block_size * LAYOUT.block_size
