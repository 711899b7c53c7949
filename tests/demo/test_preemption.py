"""Generation under preemption, by recompute and by swap to the host tier, yields the tokens it yields without:
the tiny model through a real server process, the worker's Triton kernels interpreted (TRITON_INTERPRET=1).

Each constrained run gets a server of its own, sized to preempt; the unconstrained runs it is compared with share
the demo suite's server (1024 blocks: nothing is preempted), each test in a namespace of its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo import reference
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.orchestrator import Orchestrator, RequestResult, RequestSpec, StepRecord
from radixkv.demo.sampling import SamplingParams
from radixkv.demo.server_process import ServerProcess
from radixkv.demo.worker import Worker
from radixkv.kernels.backend import INTERPRETED
from radixkv.memory.layout import PoolLayout
from radixkv.stats import Stats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not INTERPRETED and not torch.cuda.is_available(), reason="Triton needs TRITON_INTERPRET=1 or a GPU"
    ),
]
BLOCK_SIZE = 4
SYSTEM = [1] + list(range(40, 47))  # two full blocks every request shares


@dataclasses.dataclass
class Run:
    results: list[RequestResult]
    steps: list[StepRecord]
    stats: Stats


def generate(model: LlamaForCausalLM, specs: list[RequestSpec], num_blocks: int, host_blocks: int = 0) -> Run:
    """On a server of its own with a pool of `num_blocks` (and a host tier of `host_blocks`)."""
    c = model.config
    layout = PoolLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        dtype="float32",
    )
    with ServerProcess(layout, host_num_blocks=host_blocks) as address:
        return generate_on(address, model, specs, "preempt")


def generate_on(address: str, model: LlamaForCausalLM, specs: list[RequestSpec], namespace: str) -> Run:
    with RadixKVClient(address) as client, PoolView.from_client(client) as view:
        host = view.host_data if view.info.host is not None else None
        orchestrator = Orchestrator(
            client, Worker(model, view, backend="triton", host_data=host), eos_token_ids=(), namespace=namespace
        )  # no EOS
        results = orchestrator.run(specs)
        stats = client.stats()
    assert stats.num_live_sequences == 0 and stats.num_blocks_in_use == 0, "every sequence released, none leaked"
    return Run(results, orchestrator.steps, stats)


def test_preemption_by_recompute_generates_the_same_tokens(model: LlamaForCausalLM, server: str) -> None:
    specs = [
        RequestSpec(name="g1", prompt=SYSTEM + [60, 61, 62], max_new_tokens=12),
        RequestSpec(name="g2", prompt=SYSTEM + [70, 71], max_new_tokens=12),
        RequestSpec(
            name="s3",
            prompt=SYSTEM + [80, 81, 82, 83],
            max_new_tokens=12,
            sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=5),
        ),
    ]  # about 6 blocks each at the end; 12 blocks hold two
    constrained = generate(model, specs, 12)
    num_preemptions = sum(r.num_preemptions for r in constrained.results)
    assert num_preemptions > 0
    assert all(r.num_swaps == 0 for r in constrained.results)  # no host tier: recompute only
    assert sum(s.num_offloaded_blocks + s.num_loaded_blocks for s in constrained.steps) == 0
    # Each preemption kept its sequence id and came back once; a resume is not a new sequence.
    stats = constrained.stats
    assert stats.num_preemptions_recompute == stats.num_resumed_sequences == num_preemptions
    assert stats.num_opened_sequences == len(specs)
    free = generate_on(server, model, specs, "recompute-free")
    assert sum(r.num_preemptions for r in free.results) == 0
    # The resumes prefilled again what the cache no longer held (at least each one's last, partial block).
    assert sum(s.num_prefill_tokens for s in constrained.steps) > sum(s.num_prefill_tokens for s in free.steps)
    assert [r.outputs for r in constrained.results] == [r.outputs for r in free.results]
    for spec, result in zip(specs[:2], constrained.results[:2], strict=True):  # and greedy is greedy
        assert result.outputs == [reference.greedy(model, spec.prompt, 12, eos_token_ids=())], spec.name


def test_preemption_by_swap_generates_the_same_tokens(model: LlamaForCausalLM, server: str) -> None:
    specs = [
        RequestSpec(name="greedy", prompt=SYSTEM + [60, 61, 62], max_new_tokens=10),
        RequestSpec(
            name="samples",
            prompt=SYSTEM + [70, 71],
            max_new_tokens=10,
            sampling=SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7),
        ),
        RequestSpec(name="beam", prompt=SYSTEM + [80, 81, 82, 83, 84], max_new_tokens=10, beam_width=2),
    ]
    constrained = generate(model, specs, 16, host_blocks=64)
    swaps = sum(r.num_swaps for r in constrained.results)
    assert swaps > 0, "a request of several sequences was preempted by swap"
    assert constrained.stats.num_preemptions_swap > 0
    # Every block the server moved, the worker moved: what the steps applied is what the server counted.
    assert sum(s.num_offloaded_blocks for s in constrained.steps) == constrained.stats.num_offloaded_blocks > 0
    assert sum(s.num_loaded_blocks for s in constrained.steps) == constrained.stats.num_loaded_blocks > 0
    free = generate_on(server, model, specs, "swap-free")
    assert sum(r.num_preemptions for r in free.results) == 0
    assert [r.outputs for r in constrained.results] == [r.outputs for r in free.results]
    torch.testing.assert_close(torch.tensor(constrained.results[2].scores), torch.tensor(free.results[2].scores))


def test_requests_of_several_sequences_are_not_preempted_by_recompute(model: LlamaForCausalLM, server: str) -> None:
    specs = [
        RequestSpec(
            name="samples",
            prompt=SYSTEM + [70, 71],
            max_new_tokens=10,
            sampling=SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7),
        ),
        RequestSpec(name="greedy", prompt=SYSTEM + [60, 61, 62], max_new_tokens=10),
    ]
    constrained = generate(model, specs, 14)
    samples, greedy = constrained.results
    assert samples.num_preemptions == 0 and greedy.num_preemptions > 0
    free = generate_on(server, model, specs, "several-free")
    assert [r.outputs for r in constrained.results] == [r.outputs for r in free.results]
