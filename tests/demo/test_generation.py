"""Generation through a real server process, the client, the mapped pool and the kernels, against references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo import reference
from radixkv.demo.chat_template import PLAIN_TEMPLATE, ChatTemplate
from radixkv.demo.main import build_parser
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.model_source import ChatModel
from radixkv.demo.orchestrator import Orchestrator, RequestSpec
from radixkv.demo.sampling import SamplingParams
from radixkv.demo.scenario import demo_requests
from radixkv.demo.tokenizer import ByteTokenizer
from radixkv.demo.worker import Worker
from radixkv.kernels.backend import INTERPRETED

SYSTEM = [1] + list(range(40, 63))  # 24 tokens: six full blocks every request shares
EOS = (2,)


def orchestrator(
    client: RadixKVClient, view: PoolView, model: LlamaForCausalLM, namespace: str, backend: str = "torch"
) -> Orchestrator:
    return Orchestrator(
        client, Worker(model, view, backend=backend), eos_token_ids=model.config.eos_token_ids, namespace=namespace
    )


def test_greedy_through_the_service_matches_dense_reference_and_transformers(
    client: RadixKVClient, view: PoolView, model: LlamaForCausalLM, hf_llama_dir: Path
) -> None:
    specs = [
        RequestSpec(name="a", prompt=SYSTEM + [70, 71, 72], max_new_tokens=10),
        RequestSpec(name="b", prompt=SYSTEM + [80, 81, 82, 83, 84], max_new_tokens=9),
        RequestSpec(name="c", prompt=SYSTEM + [90], max_new_tokens=7),
        RequestSpec(name="a2", prompt=[95, 96, 97], max_new_tokens=6, follows="a"),
    ]
    results = orchestrator(client, view, model, "greedy").run(specs)
    for spec, result in zip(specs, results, strict=True):
        assert result.outputs == [reference.greedy(model, result.prompt, spec.max_new_tokens)], spec.name
    assert [r.num_cached_tokens for r in results[:3]] == [0, len(SYSTEM), len(SYSTEM)]  # b and c hit the system prompt
    assert results[3].prompt == results[0].prompt + results[0].outputs[0] + [95, 96, 97]
    bs = view.layout.block_size
    assert (
        results[3].num_cached_tokens == (len(results[0].prompt) + 10 - 1) // bs * bs
    )  # the whole first turn, as computed
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_llama_dir).eval()
    for spec, result in zip(specs, results, strict=True):
        generated = hf.generate(
            torch.tensor([result.prompt]), max_new_tokens=spec.max_new_tokens, do_sample=False, pad_token_id=0
        )
        assert result.outputs[0] == generated[0, len(result.prompt) :].tolist(), spec.name


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_through_the_service_matches_dense_reference(
    client: RadixKVClient, view: PoolView, model: LlamaForCausalLM, width: int
) -> None:
    prompt = SYSTEM + [100, 101, 102, 103, 104, 105]  # 30 tokens: the last block is partial, so beams share it
    [result] = orchestrator(client, view, model, f"beam-{width}").run(
        [RequestSpec(name="beam", prompt=prompt, max_new_tokens=10, beam_width=width)]
    )
    expected = reference.beam_search_dense(model, prompt, width, 10)
    assert result.outputs == [list(h.token_ids) for h in expected]
    torch.testing.assert_close(
        torch.tensor(result.scores), torch.tensor([h.score for h in expected]), atol=1e-4, rtol=1e-5
    )
    assert result.num_cow_copies > 0  # beams forked off a partial block wrote into it: copied first
    stats = client.stats()
    assert stats.num_live_sequences == 0 and stats.num_blocks_in_use == 0  # pruned and final beams all released


def test_parallel_samples_are_seeded_and_share_the_prompt(
    client: RadixKVClient, view: PoolView, model: LlamaForCausalLM
) -> None:
    spec = RequestSpec(
        name="s",
        prompt=SYSTEM + [110, 111],
        max_new_tokens=8,
        sampling=SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=7),
    )
    first = orchestrator(client, view, model, "samples-1").run([spec])[0]
    again = orchestrator(client, view, model, "samples-2").run([spec])[0]
    assert again.num_cached_tokens == 0  # another namespace: nothing of the first run is visible
    assert first.outputs == again.outputs  # same seed, same samples
    assert len({tuple(o) for o in first.outputs}) > 1
    assert all(len(o) == 8 or o[-1] in EOS for o in first.outputs)
    # Four samples of a 26-token prompt held far fewer blocks than four private copies would.
    prompt_blocks = -(-len(spec.prompt) // view.layout.block_size)
    assert first.peak_blocks < 4 * prompt_blocks


@pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="Triton needs TRITON_INTERPRET=1 or a GPU"
)
def test_triton_kernels_generate_the_same_tokens(
    client: RadixKVClient, view: PoolView, model: LlamaForCausalLM
) -> None:
    specs = [
        RequestSpec(name="g", prompt=SYSTEM[:7], max_new_tokens=4),
        RequestSpec(name="b", prompt=SYSTEM[:9], max_new_tokens=3, beam_width=2),
    ]
    results = orchestrator(client, view, model, "triton", backend="triton").run(specs)
    assert results[0].outputs == [reference.greedy(model, specs[0].prompt, 4)]
    assert results[1].outputs == [list(h.token_ids) for h in reference.beam_search_dense(model, specs[1].prompt, 2, 3)]


def test_demo_scenario_leaves_blocks_free_or_cached_and_hits_every_prompt_block_when_rerun(
    client: RadixKVClient, view: PoolView, model: LlamaForCausalLM
) -> None:
    args = build_parser().parse_args(["--max-new-tokens", "6", "--samples", "3", "--beam-width", "3"])
    c = model.config
    chat = ChatModel(
        name="hf-llama",
        model=model,
        tokenizer=ByteTokenizer(c.bos_token_id, c.eos_token_ids),
        template=ChatTemplate(PLAIN_TEMPLATE),
        random_weights=True,
    )
    specs = demo_requests(chat, args)
    first_run = orchestrator(client, view, model, "demo")
    first = first_run.run(specs)
    stats = client.stats()
    assert stats.num_live_sequences == 0 and stats.num_blocks_in_use == 0
    assert stats.num_blocks_free + stats.num_blocks_cached == stats.num_blocks_total
    assert (
        first[0].num_cached_tokens == 0 and first[1].num_cached_tokens > 0
    )  # cold start, then the shared system prompt
    assert all(s.blocks_radixkv <= s.blocks_unshared for s in first_run.steps)
    assert any(s.blocks_radixkv < s.blocks_unshared for s in first_run.steps)
    second = orchestrator(client, view, model, "demo").run(specs)
    bs = view.layout.block_size
    for result in second:  # every full block of every prompt (all but the block of its last token, recomputed)
        assert result.num_cached_tokens == (len(result.prompt) - 1) // bs * bs, result.name
    assert [r.outputs for r in second] == [r.outputs for r in first]
