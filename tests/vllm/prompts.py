"""The end-to-end prompts: a shared ~300-token system prompt with distinct questions, and a few of 600-900 tokens."""

from __future__ import annotations

from typing import Any

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32

SYSTEM = (
    "You are a careful assistant for a team that runs language models in production. "
    "Answer briefly and precisely. When you are unsure, say so and explain what you would check. "
) + " ".join(
    f"Rule {i}: keep the key-value cache of shared prefixes resident, measure the hit ratio, and never serve a block "
    f"whose bytes were not written by the model for exactly those tokens."
    for i in range(1, 9)
)
QUESTIONS = [
    "What is a paged KV cache?",
    "Why does prefix sharing save prefill time?",
    "How would you size a KV pool for a 7B model?",
    "What happens when the cache is full?",
    "Explain copy-on-write for beam search.",
    "What is the cost of a cache miss?",
    "How do you route requests to the instance holding their prefix?",
    "What does chunked prefill change?",
    "Why checksum cached blocks?",
    "How does a restart keep the cache?",
    "What is a radix tree?",
    "Name two eviction policies.",
    "What is time to first token?",
    "How do tenants stay isolated?",
    "What is a block table?",
    "Why are block sizes powers of two?",
]
DOCUMENT = " ".join(
    f"Paragraph {i}: the operator restarted the server at step {i * 7}, kept the pool in a keeper process, and "
    f"measured {i * 3} percent fewer prefill tokens afterwards."
    for i in range(1, 41)
)


def prompt_token_ids(tokenizer: Any, *, quick: bool = False) -> list[list[int]]:
    """Token ids of the prompts: 16 short ones (system prompt + question), 4 long ones (+ part of a document)."""
    system = tokenizer.encode(SYSTEM)
    questions = QUESTIONS[:6] if quick else QUESTIONS
    prompts = [system + tokenizer.encode(" Question: " + q, add_special_tokens=False) for q in questions]
    document = tokenizer.encode(" Document: " + DOCUMENT, add_special_tokens=False)
    for i, length in enumerate((300, 450, 600) if quick else (300, 420, 520, 560)):
        question = tokenizer.encode(f" Summarise paragraph {i + 3}.", add_special_tokens=False)
        prompts.append(system + document[:length] + question)
    return prompts
