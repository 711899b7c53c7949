"""The memory-pressure matrix as seeded token traces (bench_pressure.py replays them through the core).

Six scenarios, each a list of requests with their prompts and (pre-drawn) outputs, so every policy
replays exactly the same tokens:
  - short/long prompt x short/long output, every prompt under one of a few shared system prompts;
  - multi-turn chats: each conversation comes back (a revisit) some scheduler steps after its turn
    ends, and re-sends the whole conversation so far plus a new user message;
  - RAG: questions over a few shared documents (system prompt, document, question).
The working set is what an unbounded cache holds at the end: every distinct full block of every
request's prompt and output (shared system prompts and documents count once).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import numpy.typing as npt

Tokens = npt.NDArray[np.int32]
VOCAB = 32_000


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request. `follows`: the earlier turn of its conversation; it arrives `think_steps` scheduler
    steps after that turn finishes, and its prompt starts with that turn's prompt and output."""

    name: str
    prompt: Tokens
    output: Tokens  # what the model generates, drawn up front: every policy replays the same tokens
    follows: str | None = None
    think_steps: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    """Token counts are (low, high) ranges drawn uniformly."""

    num_requests: int  # per matrix scenario
    system_prompt: tuple[int, int]
    short_prompt: tuple[int, int]  # user tokens after the system prompt
    long_prompt: tuple[int, int]
    short_output: tuple[int, int]
    long_output: tuple[int, int]
    num_conversations: int
    num_turns: int
    turn_prompt: tuple[int, int]
    turn_output: tuple[int, int]
    think_steps: tuple[int, int]
    num_documents: int
    document: tuple[int, int]
    num_questions: int
    question: tuple[int, int]


FULL = Sizes(
    num_requests=96,
    system_prompt=(200, 500),
    short_prompt=(32, 256),
    long_prompt=(1536, 3072),
    short_output=(32, 128),
    long_output=(512, 1024),
    num_conversations=64,
    num_turns=5,
    turn_prompt=(32, 256),
    turn_output=(64, 384),
    think_steps=(20, 200),
    num_documents=16,
    document=(1024, 3072),
    num_questions=192,
    question=(16, 64),
)
QUICK = Sizes(
    num_requests=32,
    system_prompt=(100, 250),
    short_prompt=(16, 128),
    long_prompt=(768, 1536),
    short_output=(16, 64),
    long_output=(256, 512),
    num_conversations=24,
    num_turns=4,
    turn_prompt=(16, 128),
    turn_output=(32, 192),
    think_steps=(10, 100),
    num_documents=8,
    document=(512, 1536),
    num_questions=64,
    question=(16, 64),
)
NUM_SYSTEM_PROMPTS = 4


def scenarios(sizes: Sizes, seed: int = 0) -> dict[str, list[TraceRequest]]:
    """Every scenario's requests, reproducible from `seed`."""
    rng = np.random.default_rng(seed)

    def tokens(span: tuple[int, int]) -> Tokens:
        return rng.integers(0, VOCAB, int(rng.integers(span[0], span[1] + 1)), dtype=np.int32)

    systems = [tokens(sizes.system_prompt) for _ in range(NUM_SYSTEM_PROMPTS)]

    def system() -> Tokens:
        return systems[int(rng.integers(len(systems)))]

    out: dict[str, list[TraceRequest]] = {}
    for prompt_kind, prompt_span in (("short", sizes.short_prompt), ("long", sizes.long_prompt)):
        for output_kind, output_span in (("short", sizes.short_output), ("long", sizes.long_output)):
            out[f"{prompt_kind} prompt, {output_kind} out"] = [
                TraceRequest(f"r{i}", np.concatenate([system(), tokens(prompt_span)]), tokens(output_span))
                for i in range(sizes.num_requests)
            ]
    turns: list[TraceRequest] = []
    for c in range(sizes.num_conversations):
        history = system()
        previous: TraceRequest | None = None
        for t in range(sizes.num_turns):
            prompt = np.concatenate([history, tokens(sizes.turn_prompt)])
            think = int(rng.integers(sizes.think_steps[0], sizes.think_steps[1] + 1)) if previous else 0
            turn = TraceRequest(
                f"c{c}t{t}", prompt, tokens(sizes.turn_output), previous.name if previous else None, think
            )
            turns.append(turn)
            history, previous = np.concatenate([prompt, turn.output]), turn
    out["multi-turn"] = turns
    documents = [tokens(sizes.document) for _ in range(sizes.num_documents)]
    out["RAG, shared documents"] = [
        TraceRequest(
            f"q{i}",
            np.concatenate([systems[0], documents[int(rng.integers(len(documents)))], tokens(sizes.question)]),
            tokens(sizes.short_output),
        )
        for i in range(sizes.num_questions)
    ]
    return out


def working_set_blocks(requests: list[TraceRequest], block_size: int) -> int:
    """Distinct full blocks over every request's prompt + output, shared prefixes counted once (a trie of
    block contents: a block is identified by everything before it, as the radix tree identifies it)."""
    seen: set[bytes] = set()
    for r in requests:
        tokens = np.concatenate([r.prompt, r.output])
        digest = b""
        for start in range(0, len(tokens) - block_size + 1, block_size):
            digest = hashlib.blake2b(digest + tokens[start : start + block_size].tobytes(), digest_size=16).digest()
            seen.add(digest)
    return len(seen)
