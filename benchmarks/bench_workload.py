"""The serving load matrix, end to end: a real server process, the client, the worker and SmolLM2-135M-Instruct.

Each scenario's requests run through the demo's orchestrator (continuous batching under a token budget,
preemption by recompute) against a `radixkv serve` child process whose pool the worker maps:
  - short prompt + short output, long prompt + short output, short prompt + long output, long + long;
  - multi-turn conversations (each turn re-sends the whole conversation so far);
  - RAG: questions over a few shared documents.
Every prompt is rendered with the model's chat template and starts with one shared system prompt; the
model ignores EOS (as serving benchmarks do), so outputs have the stated lengths.

Per scenario, with the prefix cache on and off in the same run: the workload profile (prompt and output
p50/p95/p99, multi-turn share, shared-system-prompt share), TTFT and TPOT p50/p95/p99, prefill and decode
tokens/s, active sequences and waiting queue, cache hit ratio, block allocation failures, evictions; then
the TTFT ratio (off / on) for multi-turn and RAG, and one scenario again on a pool too small for it, where
requests are preempted. CPU figures are for comparing configurations within one run, not for capacity.
Each run has a fresh server process; with --quick the on/off runs share one (each in a namespace of its
own, so no run hits another's prefixes, and its counters taken as differences), which is most of what
keeps --quick under 30 s: a server start costs about as much CPU as a quick scenario.

    python benchmarks/bench_workload.py [--quick] [--out results.json] [--plot results.png] [--model PATH|tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo.model_source import ChatModel, load_chat_model
from radixkv.demo.orchestrator import Orchestrator, RequestResult, RequestSpec, StepRecord
from radixkv.demo.server_process import ServerProcess
from radixkv.demo.worker import Worker
from radixkv.memory.layout import PoolLayout

SYSTEM = (
    "You are the assistant of a company that runs language model servers. Answer in plain words, "
    "cite the document when one is given, and say so when you do not know."
)
WORDS = (
    "cache block prefix token request server batch memory model layer attention decode prefill queue latency "
    "throughput share evict tree node pool slot kernel worker session lease copy fork beam sample"
).split()
BLOCK_SIZE = 16
CPU_NOTE = "CPU figures: for comparing configurations within this run only, not a statement of serving capacity."


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    short_prompt: int  # words of user text (the chat template and system prompt come on top)
    long_prompt: int
    short_output: int
    long_output: int
    num_requests: int
    num_conversations: int
    num_turns: int
    num_documents: int
    document_words: int


QUICK = Sizes(6, 40, 2, 4, 3, 2, 2, 2, 48)  # the smallest matrix that still shows each effect (2 server processes)
FULL = Sizes(12, 300, 8, 64, 8, 3, 4, 3, 220)


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."


def ask(chat: ChatModel, user: str) -> list[int]:
    return chat.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


def scenarios(chat: ChatModel, s: Sizes) -> dict[str, list[RequestSpec]]:
    """Each scenario's requests, as token ids (seeded: the same every run)."""
    rng = random.Random(0)
    out: dict[str, list[RequestSpec]] = {}
    for prompt_kind, words in (("short", s.short_prompt), ("long", s.long_prompt)):
        for output_kind, n in (("short", s.short_output), ("long", s.long_output)):
            out[f"{prompt_kind} prompt, {output_kind} out"] = [
                RequestSpec(name=f"r{i}", prompt=ask(chat, f"Question {i}: {text(rng, words)}"), max_new_tokens=n)
                for i in range(s.num_requests)
            ]
    turns = []
    for c in range(s.num_conversations):
        history = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {c}: {text(rng, s.short_prompt)}"},
        ]
        turns.append(RequestSpec(name=f"c{c}t0", prompt=chat.encode_chat(history), max_new_tokens=s.short_output))
        for t in range(1, s.num_turns):
            question = f"Turn {t}: {text(rng, s.short_prompt)}"
            turns.append(
                RequestSpec(
                    name=f"c{c}t{t}",
                    prompt=chat.encode_next_turn(history, question),
                    max_new_tokens=s.short_output,
                    follows=f"c{c}t{t - 1}",
                )
            )
            history += [{"role": "assistant", "content": "..."}, {"role": "user", "content": question}]
    out["multi-turn"] = turns
    documents = [text(rng, s.document_words) for _ in range(s.num_documents)]
    out["RAG, shared documents"] = [
        RequestSpec(
            name=f"q{i}",
            prompt=ask(
                chat,
                f"Document {i % s.num_documents}: {documents[i % s.num_documents]}\nQuestion: "
                f"{text(rng, s.short_prompt)}",
            ),
            max_new_tokens=s.short_output,
        )
        for i in range(2 * s.num_requests)
    ]
    return out


def percentiles(values: list[float]) -> list[float]:
    return [float(np.percentile(values, q)) for q in (50, 95, 99)] if values else [0.0, 0.0, 0.0]


def profile(specs: list[RequestSpec], results: list[RequestResult]) -> dict[str, Any]:
    """The workload as served: prompt and output lengths, the multi-turn share, the shared-system-prompt share."""
    system = ask_prefix_len(results)
    return {
        "prompt_tokens_p50_p95_p99": percentiles([float(len(r.prompt)) for r in results]),
        "output_tokens_p50_p95_p99": percentiles([float(len(r.outputs[0])) for r in results]),
        "multi_turn_share": sum(s.follows is not None for s in specs) / len(specs),
        "shared_system_prompt_share": sum(r.prompt[:system] == results[0].prompt[:system] for r in results)
        / len(results),
    }


def ask_prefix_len(results: list[RequestResult]) -> int:
    """Tokens every prompt shares with the first (the system prompt, as the template renders it)."""
    first = results[0].prompt
    n = min(len(r.prompt) for r in results)
    for r in results[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], r.prompt[:n], strict=False)) if a != b), n)
    return n


def layout_for(chat: ChatModel, num_blocks: int) -> PoolLayout:
    c = chat.model.config
    return PoolLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        dtype="float32",
    )


def run(
    chat: ChatModel,
    specs: list[RequestSpec],
    num_blocks: int,
    prefix_caching: bool,
    max_batch_tokens: int,
    address: str | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    """One scenario through a fresh server process (or the one at `address`, in `namespace`); its figures."""
    if address is None:
        with ServerProcess(layout_for(chat, num_blocks)) as fresh:
            return run(chat, specs, num_blocks, prefix_caching, max_batch_tokens, fresh, namespace)
    with RadixKVClient(address) as client, PoolView.from_client(client) as view:
        before = client.stats()
        orchestrator = Orchestrator(
            client,
            Worker(chat.model, view, backend="torch"),
            eos_token_ids=(),
            namespace=namespace,
            max_batch_tokens=max_batch_tokens,
            prefix_caching=prefix_caching,
        )  # no EOS: outputs have their stated lengths
        started = time.perf_counter()
        results = orchestrator.run(specs)
        seconds = time.perf_counter() - started
        stats = client.stats()
    num_requested = stats.num_requested_tokens - before.num_requested_tokens
    steps: list[StepRecord] = orchestrator.steps
    tpot = [(r.seconds - r.ttft) / (len(r.outputs[0]) - 1) for r in results if len(r.outputs[0]) > 1]
    return {
        "profile": profile(specs, results),
        "seconds": seconds,
        "ttft_ms_p50_p95_p99": [x * 1e3 for x in percentiles([r.ttft for r in results])],
        "tpot_ms_p50_p95_p99": [x * 1e3 for x in percentiles(tpot)],
        "prefill_tokens_per_s": sum(s.num_prefill_tokens for s in steps) / seconds,
        "decode_tokens_per_s": sum(s.num_decodes for s in steps) / seconds,
        "active_seqs_mean_max": [float(np.mean([s.num_live_seqs for s in steps])), max(s.num_live_seqs for s in steps)],
        "waiting_mean_max": [float(np.mean([s.num_waiting for s in steps])), max(s.num_waiting for s in steps)],
        "hit_ratio": (stats.num_hit_tokens - before.num_hit_tokens) / num_requested if num_requested else 0.0,
        "allocation_failures": stats.num_allocation_failures - before.num_allocation_failures,
        "evicted_blocks": stats.num_evicted_blocks - before.num_evicted_blocks,
        "preemptions": sum(s.num_preempted for s in steps),
        "blocks_in_use": [s.blocks_radixkv for s in steps],
    }


def format_table(rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    header = (
        f"{'scenario':<24} {'cache':<5} {'prompt p50/p99':>14} {'out':>4} {'TTFT ms p50/p95/p99':>21} "
        f"{'TPOT ms p50/p99':>16} "
        f"{'prefill t/s':>11} {'decode t/s':>10} {'active':>9} {'queue':>9} {'hit':>5} {'fail':>4} {'evict':>5} "
        f"{'preempt':>7}"
    )
    lines = [header, "-" * len(header)]
    for name, by_cache in rows.items():
        for cache, r in by_cache.items():
            p, ttft, tpot = r["profile"], r["ttft_ms_p50_p95_p99"], r["tpot_ms_p50_p95_p99"]
            prompt = p["prompt_tokens_p50_p95_p99"]
            lines.append(
                f"{name:<24} {cache:<5} {prompt[0]:>6.0f}/{prompt[2]:<7.0f} {p['output_tokens_p50_p95_p99'][0]:>4.0f} "
                f"{ttft[0]:>6.0f}/{ttft[1]:>6.0f}/{ttft[2]:>7.0f} {tpot[0]:>7.1f}/{tpot[2]:>8.1f} "
                f"{r['prefill_tokens_per_s']:>11.0f} {r['decode_tokens_per_s']:>10.1f} "
                f"{r['active_seqs_mean_max'][0]:>5.1f}/{r['active_seqs_mean_max'][1]:<3} "
                f"{r['waiting_mean_max'][0]:>5.1f}/{r['waiting_mean_max'][1]:<3} "
                f"{r['hit_ratio']:>5.2f} {r['allocation_failures']:>4} {r['evicted_blocks']:>5} {r['preemptions']:>7}"
            )
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, dict[str, Any]]], path: str) -> None:
    import matplotlib  # only --plot needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [n for n in rows if "on" in rows[n] and "off" in rows[n]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(names))
    for offset, cache in ((-0.2, "on"), (0.2, "off")):
        left.bar(
            x + offset, [rows[n][cache]["ttft_ms_p50_p95_p99"][0] for n in names], 0.4, label=f"prefix cache {cache}"
        )
    left.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    left.set_ylabel("TTFT p50 (ms, CPU)")
    left.set_title("time to first token, prefix cache on vs off")
    left.legend()
    for name, by_cache in rows.items():
        for cache, r in by_cache.items():
            right.plot(r["blocks_in_use"], label=f"{name} ({cache})", linewidth=1)
    right.set_xlabel("scheduler step")
    right.set_ylabel("KV blocks in use")
    right.set_title("blocks in use per step")
    right.legend(fontsize=6)
    fig.suptitle(CPU_NOTE, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", metavar="FILE.png", help="draw TTFT on/off and blocks in use per step")
    parser.add_argument(
        "--model", help="a GGUF file, a checkpoint directory or 'tiny' (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the server shares the CPU)")
    args = parser.parse_args(argv)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # unwind: each run's server process is stopped, not orphaned
    torch.set_num_threads(args.threads)
    chat = load_chat_model(args.model)
    sizes = QUICK if args.quick else FULL
    print(f"model {chat.name}; block size {BLOCK_SIZE}; max {args.max_batch_tokens} tokens per step; {CPU_NOTE}\n")
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        shared = stack.enter_context(ServerProcess(layout_for(chat, 1024))) if args.quick else None
        for i, (name, specs) in enumerate(scenarios(chat, sizes).items()):
            rows[name] = {
                cache: run(chat, specs, 1024, cache == "on", args.max_batch_tokens, shared, f"run{i}-{cache}")
                for cache in ("on", "off")
            }
    # Short prompts with outputs three times as long, on a pool that holds the prompts but not their growth:
    # admission keeps a block of headroom per sequence, decodes outgrow it, the latest request is preempted.
    specs = [
        dataclasses.replace(s, max_new_tokens=3 * s.max_new_tokens)
        for s in scenarios(chat, sizes)["short prompt, long out"]
    ]
    need = [-(-(len(s.prompt) + s.max_new_tokens) // BLOCK_SIZE) for s in specs]
    small = max(need) + 2
    rows[f"short/3x long, {small} blocks"] = {"on": run(chat, specs, small, True, args.max_batch_tokens)}
    print(format_table(rows))
    ratios = {
        n: rows[n]["off"]["ttft_ms_p50_p95_p99"][0] / max(rows[n]["on"]["ttft_ms_p50_p95_p99"][0], 1e-9)
        for n in ("multi-turn", "RAG, shared documents")
    }
    print()
    for n, ratio in ratios.items():
        print(f"{n}: TTFT p50 with the prefix cache off / on = {ratio:.2f}x")
    for n in rows:
        p = next(iter(rows[n].values()))["profile"]
        print(
            f"profile {n}: multi-turn share {p['multi_turn_share']:.2f}, shared system prompt share "
            f"{p['shared_system_prompt_share']:.2f}, "
            f"output p50/p95/p99 {'/'.join(f'{x:.0f}' for x in p['output_tokens_p50_p95_p99'])}"
        )
    print(f"\n{CPU_NOTE}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "model": chat.name,
                    "sizes": dataclasses.asdict(sizes),
                    "rows": rows,
                    "ttft_ratio_off_on": ratios,
                    "note": CPU_NOTE,
                },
                f,
                indent=2,
            )
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
