"""Continuous batching: the admission policy, preemption by recompute when the pool runs short, chat prompts."""

from __future__ import annotations

import pytest

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo import reference
from radixkv.demo.admission import Admission
from radixkv.demo.chat_template import PLAIN_TEMPLATE, ChatTemplate
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.orchestrator import Orchestrator, RequestSpec
from radixkv.demo.server_process import ServerProcess
from radixkv.demo.worker import Worker
from radixkv.memory.layout import PoolLayout

SMOLLM_STYLE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class CachedPrefixes:
    """A prober that knows how many leading tokens of each prompt (by its first token) are cached."""

    def __init__(self, cached: dict[int, int]) -> None:
        self.cached = cached

    def match(self, token_ids: list[int], namespace: str) -> int:
        return self.cached.get(token_ids[0], 0)


def test_admission_fills_the_token_budget_first_come_first_served() -> None:
    policy = Admission(max_batch_tokens=100, block_size=4)
    prompts = [[1] * 40, [2] * 40, [3] * 40, [4] * 8]
    assert policy.choose(prompts, CachedPrefixes({}), "ns", 0, 1000) == [0, 1]  # the third does not fit: none jumps it
    assert policy.choose(prompts, CachedPrefixes({3: 32}), "ns", 0, 1000) == [0, 1, 2, 3]  # 8 new tokens of the third
    assert policy.choose(prompts, CachedPrefixes({}), "ns", 30, 1000) == [0]  # decodes take 30 tokens of the budget
    assert policy.choose([[1] * 500], CachedPrefixes({}), "ns", 0, 1000) == [0]  # alone, a long prompt still runs
    assert policy.choose([[1] * 500], CachedPrefixes({}), "ns", 3, 1000) == []  # ...but not past running decodes


def test_admission_defers_a_prompt_whose_prefix_is_computed_in_this_step() -> None:
    policy = Admission(max_batch_tokens=1000, block_size=4)
    system = list(range(100, 112))  # three full blocks every prompt shares
    prompts = [system + [1, 2], system + [3, 4], [7, 8, 9]]
    assert policy.choose(prompts, CachedPrefixes({}), "ns", 0, 1000) == [0, 2]  # the second waits a step, then hits
    assert policy.choose(prompts, CachedPrefixes({100: 12}), "ns", 0, 1000) == [0, 1, 2]  # cached: nothing to wait for
    mostly_own = [system[:4] + [1] * 20, system[:4] + [2] * 20]  # one shared block of 24 tokens: not worth a step
    assert policy.choose(mostly_own, CachedPrefixes({}), "ns", 0, 1000) == [0, 1]


def test_admission_keeps_a_block_of_headroom_per_live_sequence() -> None:
    policy = Admission(max_batch_tokens=1000, block_size=4)
    prompts = [[1] * 16, [2] * 16]  # four blocks each
    assert policy.choose(prompts, CachedPrefixes({}), "ns", 0, 10) == [0, 1]
    assert policy.choose(prompts, CachedPrefixes({}), "ns", 0, 9) == [0]  # the first's next append needs a block too
    assert policy.choose(prompts, CachedPrefixes({}), "ns", 2, 5) == []
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Admission(0, 4)


def test_preemption_by_recompute_keeps_greedy_output_exact_and_leaks_nothing(model: LlamaForCausalLM) -> None:
    c = model.config
    layout = PoolLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=4,
        num_blocks=12,
        dtype="float32",
    )  # 12 blocks: too few for all three
    specs = [
        RequestSpec(name=f"r{i}", prompt=[1] + [10 * i + j for j in range(10, 17)], max_new_tokens=14)
        for i in range(1, 4)
    ]  # 8 + 14 tokens: 6 blocks each
    with ServerProcess(layout) as address, RadixKVClient(address) as client, PoolView.from_client(client) as view:
        orchestrator = Orchestrator(
            client, Worker(model, view, backend="torch"), eos_token_ids=(), namespace="preempt"
        )  # no EOS: every request runs 14 tokens
        results = orchestrator.run(specs)
        stats = client.stats()
    assert sum(r.num_preemptions for r in results) > 0
    assert sum(s.num_preempted for s in orchestrator.steps) == sum(r.num_preemptions for r in results)
    assert max(s.num_prefills for s in orchestrator.steps) >= 2  # several prompts admitted in one step
    for spec, result in zip(specs, results, strict=True):
        assert result.outputs == [reference.greedy(model, spec.prompt, 14, eos_token_ids=())], spec.name
    assert stats.num_live_sequences == 0 and stats.num_blocks_in_use == 0
    assert stats.num_blocks_free + stats.num_blocks_cached == 12


def test_chat_template_renders_and_continues_a_conversation() -> None:
    template = ChatTemplate(SMOLLM_STYLE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert (
        template.render(messages)
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        template.continuation(messages, "Why?")
        == "<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = ChatTemplate(PLAIN_TEMPLATE)
    assert plain.render(messages) == "System: Be brief.\nUser: Hi?\nAssistant: "
    assert plain.continuation(messages, "Why?") == "\nUser: Why?\nAssistant: "
    with pytest.raises(ValueError, match="chat template: roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(messages)
    with pytest.raises(ValueError, match="unsafe"):  # the sandbox refuses Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(messages)
