"""benchmarks/bench_pressure.py: its scheduler loop against unbounded and tight pools, and the `--quick` run end to
end. Asserts what the policies compute and move (counts), never a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from radixkv.server.process.spawn import patient

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import pressure_trace  # noqa: E402 - sibling scripts of the benchmark, not a package
from pressure_loop import Scheduler  # noqa: E402
from pressure_policies import HOST_FACTOR, NoHostTier, PreemptRecompute, PreemptSwap  # noqa: E402

BLOCK_SIZE = 16
TINY = pressure_trace.Sizes(
    num_requests=6,
    system_prompt=(40, 60),
    short_prompt=(8, 24),
    long_prompt=(100, 140),
    short_output=(8, 20),
    long_output=(60, 90),
    num_conversations=6,
    num_turns=3,
    turn_prompt=(8, 24),
    turn_output=(16, 40),
    think_steps=(5, 30),
    num_documents=3,
    document=(80, 120),
    num_questions=10,
    question=(4, 12),
)


def serve(requests: list[pressure_trace.TraceRequest], num_blocks: int, policy=None, max_num_seqs: int = 8):
    policy = policy or NoHostTier()
    cache = policy.make_cache(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(
        cache,
        policy,
        max_num_seqs=max_num_seqs,
        max_batch_tokens=512,
        num_trace_tokens=sum(r.num_tokens for r in requests),
    )
    counters = scheduler.run(requests)
    cache.check_invariants()
    assert not cache.sequence_ids()
    # A preempted request keeps what it generated: each output token is generated exactly once.
    assert counters.num_generated_tokens == sum(len(r.output) for r in requests)
    return counters, cache


def test_the_trace_is_seeded_and_turns_extend_their_conversation() -> None:
    first, again = pressure_trace.scenarios(TINY, seed=3), pressure_trace.scenarios(TINY, seed=3)
    assert list(first) == [
        "short prompt, short out",
        "short prompt, long out",
        "long prompt, short out",
        "long prompt, long out",
        "multi-turn",
        "RAG, shared documents",
    ]
    for name in first:
        assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(first[name], again[name], strict=True))
    turns = {r.name: r for r in first["multi-turn"]}
    for r in turns.values():
        if r.follows is not None:
            earlier = turns[r.follows]
            history = np.concatenate([earlier.prompt, earlier.output])
            assert np.array_equal(r.prompt[: len(history)], history) and len(r.prompt) > len(history)


def test_working_set_counts_shared_prefixes_once() -> None:
    shared = np.arange(64, dtype=np.int32)  # four blocks
    a = pressure_trace.TraceRequest("a", np.concatenate([shared, np.full(32, 7, np.int32)]), np.zeros(0, np.int32))
    b = pressure_trace.TraceRequest("b", np.concatenate([shared, np.full(40, 9, np.int32)]), np.zeros(0, np.int32))
    assert pressure_trace.working_set_blocks([a, b], BLOCK_SIZE) == 4 + 2 + 2  # b's partial last block not counted


@pytest.mark.parametrize("scenario", ["short prompt, long out", "multi-turn", "RAG, shared documents"])
def test_an_unbounded_pool_never_preempts_or_recomputes(scenario: str) -> None:
    requests = pressure_trace.scenarios(TINY)[scenario]
    counters, _ = serve(requests, 100_000)
    assert counters.num_preemptions == 0 and counters.num_recomputed_tokens == 0
    if scenario == "multi-turn":  # every revisit hits everything its conversation computed before
        assert counters.num_revisit_device_hit_tokens == counters.num_revisit_prior_tokens > 0


def test_no_host_tier_under_pressure_preempts_and_recomputes_what_it_dropped() -> None:
    requests = pressure_trace.scenarios(TINY)["short prompt, long out"]
    working_set = pressure_trace.working_set_blocks(requests, BLOCK_SIZE)
    counters, _ = serve(requests, working_set // 3)
    assert counters.num_preemptions > 0
    # A victim re-opens its prompt and what it generated: most of it recomputed (the system prompt may still hit).
    assert counters.num_recomputed_tokens > 0
    assert counters.num_recomputed_tokens <= counters.num_prefill_tokens
    assert counters.num_offloaded_blocks == counters.num_loaded_blocks == 0


@pytest.mark.parametrize("scenario", ["short prompt, long out", "long prompt, long out"])
def test_preempt_by_recompute_resumes_under_the_same_ids_and_hits_what_it_published(scenario: str) -> None:
    requests = pressure_trace.scenarios(TINY)[scenario]
    num_blocks = pressure_trace.working_set_blocks(requests, BLOCK_SIZE) // 3
    scratch, _ = serve(requests, num_blocks, NoHostTier())
    recompute, cache = serve(requests, num_blocks, PreemptRecompute())
    stats = cache.stats()
    assert recompute.num_preemptions > 0
    assert stats.num_preemptions_recompute == stats.num_resumed_sequences == recompute.num_preemptions
    assert stats.num_opened_sequences == len(requests)  # a resume is not a new sequence
    # Published at preemption, a victim's generated blocks are still cached when it resumes: more of what it
    # re-opens hits than when it was released without caching (only its prompt, published at prefill, stays).
    assert scratch.num_reopened_tokens and recompute.num_reopened_tokens
    hit = recompute.num_reopen_hit_tokens / recompute.num_reopened_tokens
    assert hit > scratch.num_reopen_hit_tokens / scratch.num_reopened_tokens and hit > 0.8


def test_multi_turn_on_a_small_pool_loses_revisited_history() -> None:
    requests = pressure_trace.scenarios(TINY)["multi-turn"]
    working_set = pressure_trace.working_set_blocks(requests, BLOCK_SIZE)
    counters, _ = serve(requests, working_set // 4)
    assert counters.num_revisit_prior_tokens > 0
    assert counters.num_revisit_device_hit_tokens < 0.8 * counters.num_revisit_prior_tokens  # evicted between turns
    assert counters.num_recomputed_tokens > 0


@pytest.mark.parametrize("scenario", ["short prompt, long out", "long prompt, long out"])
def test_swap_brings_preempted_sequences_back_whole(scenario: str) -> None:
    requests = pressure_trace.scenarios(TINY)[scenario]
    num_blocks = pressure_trace.working_set_blocks(requests, BLOCK_SIZE) // 3
    scratch, _ = serve(requests, num_blocks, NoHostTier())
    swap, cache = serve(requests, num_blocks, PreemptSwap())
    stats = cache.stats()
    assert stats.num_host_blocks_total == HOST_FACTOR * num_blocks
    assert swap.num_preemptions > 0 and stats.num_preemptions_swap == swap.num_preemptions
    assert stats.num_resumed_sequences == swap.num_preemptions
    assert swap.num_offloaded_blocks == stats.num_offloaded_blocks > 0 and swap.num_loaded_blocks > 0
    # The host tier holds the whole working set: what a victim had computed comes back, none is computed twice.
    assert scratch.num_recomputed_tokens > 0 and swap.num_recomputed_tokens == 0
    assert swap.num_prefill_tokens < scratch.num_prefill_tokens


def test_multi_turn_revisits_load_their_history_from_the_host_tier() -> None:
    requests = pressure_trace.scenarios(TINY)["multi-turn"]
    num_blocks = pressure_trace.working_set_blocks(requests, BLOCK_SIZE) // 4
    scratch, _ = serve(requests, num_blocks, NoHostTier())
    swap, cache = serve(requests, num_blocks, PreemptSwap())
    assert swap.num_revisit_prior_tokens == scratch.num_revisit_prior_tokens > 0  # the same history comes back
    missed = swap.num_revisit_prior_tokens - swap.num_revisit_device_hit_tokens
    assert missed > 0, "the device pool evicted history between turns"
    assert swap.num_revisit_host_hit_tokens >= 0.8 * missed
    assert swap.num_host_hit_tokens == cache.stats().num_host_hit_tokens
    assert 2 * swap.num_recomputed_tokens <= scratch.num_recomputed_tokens


def test_a_pool_too_small_for_one_request_is_an_error_not_a_hang() -> None:
    requests = pressure_trace.scenarios(TINY)["long prompt, long out"]
    with pytest.raises(RuntimeError, match="cannot hold request"):
        serve(requests, 4)


def test_quick_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "pressure.json"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_pressure.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=patient(240),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "a model, not a measurement" in run.stdout and "recomp" in run.stdout, "the table is printed"
    result = json.loads(out.read_text())
    assert result["bytes_per_block"] == 2 * 32 * 8 * 128 * 2 * BLOCK_SIZE  # Llama-3-8B bf16: K and V, 32 layers
    assert set(result["rows"]) == set(pressure_trace.scenarios(TINY))
    for row in result["rows"].values():
        assert row["num_blocks"] < row["working_set_blocks"] / 3
        assert list(row["policies"]) == [NoHostTier.name, PreemptRecompute.name, PreemptSwap.name]
        for r in row["policies"].values():
            moved = r["num_offloaded_blocks"] + r["num_loaded_blocks"]
            assert r["cost"]["bytes_moved"] == moved * result["bytes_per_block"]
    # The targets, from the counts themselves: with the host tier, multi-turn recomputes at most half of
    # what it recomputes without one, and revisited conversations find at least 80% of their lost history there.
    multi_turn = result["rows"]["multi-turn"]["policies"]
    none, swap = multi_turn[NoHostTier.name], multi_turn[PreemptSwap.name]
    assert none["num_recomputed_tokens"] > 0
    assert swap["num_recomputed_tokens"] <= 0.5 * none["num_recomputed_tokens"]
    assert swap["revisit_host_hit_ratio"] >= 0.8
    assert none["num_offloaded_blocks"] == none["num_loaded_blocks"] == 0
    assert all(t["met"] for t in result["targets"].values()) and "NOT MET" not in run.stdout
