"""The demo's scenario: its requests, generated through a server process, and everything it prints.

On SmolLM2-135M-Instruct with its chat template: requests that share a system prompt (prefix hits), one
greedy, one with `n` parallel samples (forks), one with beam search (forks, pruning, copy-on-write), and a
second turn of the first conversation (a hit on the whole first turn), batched continuously under a token
budget. A line per step, then a table per request, the run's KV memory against unshared paged blocks and
contiguous max-length slabs, and every answer as text. `radixkv.demo.main` parses the flags and imports
this module (torch, the model, the client: seconds) only after its first line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo.model_source import ChatModel, load_chat_model
from radixkv.demo.orchestrator import Orchestrator, PoolTooSmall, RequestResult, RequestSpec, StepRecord
from radixkv.demo.report import MemorySummary, format_memory, format_moves, format_requests, format_step, plot_blocks
from radixkv.demo.sampling import SamplingParams
from radixkv.demo.server_process import ServerProcess
from radixkv.demo.worker import Worker
from radixkv.memory.layout import PoolLayout, canonical_dtype
from radixkv.stats import Stats

SYSTEM_PROMPT = (
    "You are the radixkv demo assistant. You answer questions about serving large language models: batching, "
    "KV caches, prefix sharing, memory and latency. Answer in one or two plain sentences, without lists, and say "
    "so when you are not sure."
)  # several blocks long, as system prompts are: every request hits it
QUESTIONS = {
    "greedy": "What is a KV cache in a language model server?",
    "samples": "Give one reason to cache prompt prefixes.",
    "beam": "What does copy-on-write mean?",
}
FOLLOW_UP = "Why is it worth sharing between requests?"
UNCONSTRAINED_BLOCKS = 1024  # the default pool: the demo's requests never preempt there
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # main.DTYPE_NAMES


def demo_requests(chat: ChatModel, args: argparse.Namespace) -> list[RequestSpec]:
    """The scenario's requests, as token ids: three questions under one system prompt, then a second turn."""

    def conversation(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]

    n = args.max_new_tokens
    sampling = SamplingParams(n=args.samples, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return [
        RequestSpec(name="greedy", prompt=chat.encode_chat(conversation(QUESTIONS["greedy"])), max_new_tokens=n),
        RequestSpec(
            name="samples",
            prompt=chat.encode_chat(conversation(QUESTIONS["samples"])),
            max_new_tokens=n,
            sampling=sampling,
        ),
        RequestSpec(
            name="beam",
            prompt=chat.encode_chat(conversation(QUESTIONS["beam"])),
            max_new_tokens=n,
            beam_width=args.beam_width,
        ),
        RequestSpec(
            name="turn-2",
            prompt=chat.encode_next_turn(conversation(QUESTIONS["greedy"]), FOLLOW_UP),
            max_new_tokens=n,
            follows="greedy",
        ),
    ]


def format_answers(chat: ChatModel, specs: list[RequestSpec], results: list[RequestResult]) -> str:
    """Every answer as text: each sample, each beam hypothesis with its log-probability. An answer that
    reached `max_new_tokens` before its end-of-turn token ends in a marker saying it was cut there."""
    questions = {**QUESTIONS, "turn-2": FOLLOW_UP}
    eos = chat.model.config.eos_token_ids
    lines = []
    for spec, result in zip(specs, results, strict=True):
        lines.append(f"[{spec.name}] user: {questions.get(spec.name, '')}")
        for i, output in enumerate(result.outputs):
            score = f" (log p {result.scores[i]:.2f})" if result.scores else ""
            label = f"  answer {i}{score}: " if len(result.outputs) > 1 else "  answer: "
            cut = len(output) >= spec.max_new_tokens and not (output and output[-1] in eos)
            marker = f" [... cut at --max-new-tokens {spec.max_new_tokens}]" if cut else ""
            lines.append(label + chat.tokenizer.decode(output).strip().replace("\n", " ") + marker)
    return "\n".join(lines)


def compare(label: str, results: list[RequestResult], again: list[RequestResult]) -> list[str]:
    """Print whether `again` generated the same tokens as `results`; returns the requests whose outputs differ."""
    differ = [a.name for a, b in zip(results, again, strict=True) if a.outputs != b.outputs]
    print(f"outputs token-identical to {label}: {'yes' if not differ else 'NO, ' + ', '.join(differ) + ' differ'}")
    return differ


def generate(
    chat: ChatModel,
    layout: PoolLayout,
    args: argparse.Namespace,
    specs: list[RequestSpec],
    host_blocks: int,
    on_step: Callable[[StepRecord], None] | None,
) -> tuple[list[RequestResult], Orchestrator, Stats, float]:
    """Run `specs` through a fresh server process holding `layout` (and a host tier of `host_blocks`)."""
    with (
        ServerProcess(layout, host_num_blocks=host_blocks) as address,
        RadixKVClient(address) as client,
        PoolView.from_client(client) as view,
    ):
        if on_step is not None:
            print(f"server at {address}; worker maps the pool ({view.info.device}); session {client.session_id}\n")
        orchestrator = Orchestrator(
            client,
            Worker(chat.model, view, backend=args.backend, host_data=view.host_data if host_blocks else None),
            eos_token_ids=chat.model.config.eos_token_ids,
            on_step=on_step,
            max_batch_tokens=args.max_batch_tokens,
        )
        started = time.perf_counter()
        results = orchestrator.run(specs)
        return results, orchestrator, client.stats(), time.perf_counter() - started


def run(args: argparse.Namespace, started: float) -> int:
    """The demo for `radixkv demo`'s parsed flags (`started`: when it began); returns the exit status."""
    torch.set_num_threads(args.threads)
    try:
        chat = load_chat_model(args.model, DTYPES[args.dtype], args.model_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"radixkv demo: {e}", file=sys.stderr)
        return 2
    c = chat.model.config
    kv_dtype = canonical_dtype(args.kv_dtype or args.dtype)
    layout = PoolLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        dtype=kv_dtype,
    )
    specs = demo_requests(chat, args)
    print(
        f"model {chat.name}: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_q_heads} q / {c.num_kv_heads} kv "
        f"heads, head_dim {c.head_dim} (loaded in {time.perf_counter() - started:.1f} s)"
    )
    lossy = kv_dtype != canonical_dtype(args.dtype)
    print(
        f"pool: {layout.num_blocks} blocks x {layout.block_size} tokens, {layout.total_bytes / 2**20:.1f} MiB of "
        f"{kv_dtype}, in a server process"
        + (f" (lossy: K/V rounded from the model's {args.dtype}; answers may change)" if lossy else "")
    )
    print(f"system prompt shared by every request: {SYSTEM_PROMPT!r}")
    if args.host_blocks:
        print(f"host tier: {args.host_blocks} blocks, {args.host_blocks * layout.bytes_per_block / 2**20:.1f} MiB")
    try:
        outcome = generate(chat, layout, args, specs, args.host_blocks, lambda r: print(format_step(r)))
    except PoolTooSmall as e:
        hint = (
            " (or try --host-blocks, a host tier to swap it out to)"
            if e.host_tier_helps and not args.host_blocks
            else ""
        )
        print(
            f"radixkv demo: --num-blocks {args.num_blocks} is too small: {e}; give more blocks{hint}", file=sys.stderr
        )
        return 2
    results, orchestrator, stats, seconds = outcome
    print()
    print(format_requests(specs, results))
    print()
    print(format_memory(MemorySummary.of(orchestrator.steps, layout)))
    if any(r.num_preemptions for r in results):
        print(format_moves(orchestrator.steps, layout))
        unconstrained = dataclasses.replace(layout, num_blocks=max(UNCONSTRAINED_BLOCKS, args.num_blocks))
        label = f"an unconstrained run ({unconstrained.num_blocks} blocks, no preemption)"
        print(
            f"\nre-running the {len(specs)} requests as {label}, to check that preemption changed no token "
            f"(about {seconds:.0f} s, as long as the run) ...",
            flush=True,
        )
        again = generate(chat, unconstrained, args, specs, 0, None)[0]
        if compare(label, results, again):
            return 1  # preemption must not change a single token
    if lossy:  # the same requests on a pool of the model's dtype: what the rounding changed
        exact = dataclasses.replace(layout, dtype=canonical_dtype(args.dtype))
        print(
            f"\nre-running the {len(specs)} requests on a {exact.dtype} pool, to show what the {kv_dtype} pool's "
            f"rounding changed (about {seconds:.0f} s, as long as the run) ...",
            flush=True,
        )
        again = generate(chat, exact, args, specs, args.host_blocks, None)[0]
        compare(f"a {exact.dtype} pool (the {kv_dtype} pool rounds K/V, so answers may differ)", results, again)
    print(
        f"\nserver after the run: {stats.num_blocks_free} blocks free, {stats.num_blocks_cached} cached, "
        f"{stats.num_live_sequences} live sequences; prefix hits {stats.num_hit_tokens}/{stats.num_requested_tokens} "
        "prompt tokens"
    )
    print(f"{len(orchestrator.steps)} steps in {seconds:.1f} s\n")
    if chat.random_weights:
        print("(the tiny model has seeded random weights: its text is noise; what it shares is the point)")
    print(format_answers(chat, specs, results))
    if args.plot:
        plot_blocks(orchestrator.steps, args.plot, layout.block_size)
        print(f"\nplot: {args.plot}")
    return 0
