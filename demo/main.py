"""`radixkv demo`: several chat requests through a real server process, the client, a mapped pool and the kernels.

The scenario: requests that share a system prompt (prefix hits), one with `n` parallel samples
(forks), one with beam search (forks, pruning, copy-on-write), and a second turn of the first
conversation (a hit on the whole first turn). A line per step, then a table per request and the
run's KV memory against unshared paged blocks and contiguous max-length slabs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo.checkpoint import default_model_dir, ensure_tiny_llama
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.orchestrator import Orchestrator, RequestSpec
from radixkv.demo.report import MemorySummary, format_memory, format_requests, format_step, plot_blocks
from radixkv.demo.sampling import SamplingParams
from radixkv.demo.server_process import ServerProcess
from radixkv.demo.tokenizer import Tokenizer, load_tokenizer
from radixkv.demo.worker import Worker
from radixkv.layout import PoolLayout, canonical_dtype

SYSTEM_PROMPT = (
    "System: You are the radixkv demo assistant. You answer questions about serving large language models, "
    "briefly and precisely.\n"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixkv demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="PATH", help="a Hugging Face Llama/Mistral/Qwen2 checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--model-dir", metavar="DIR", help=f"where the embedded tiny model is created on first use (default {default_model_dir()})")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=1024, help="blocks in the server's pool (default 1024)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model and pool dtype (default float32)")
    p.add_argument(
        "--kv-dtype", choices=[*sorted(DTYPES), "fp8"],
        help="pool dtype, when not the model's: fp8 (e4m3, per-layer scales 1.0) holds twice the tokens per byte",
    )
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per request (default 24)")
    p.add_argument("--samples", type=int, default=4, help="parallel samples of the sampling request (default 4)")
    p.add_argument("--beam-width", type=int, default=4, help="beams of the beam-search request (default 4)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--backend", choices=["torch", "triton"], help="kernel backend (default: Triton on CUDA, torch on CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the model is tiny, the server shares the CPU)")
    p.add_argument("--plot", metavar="FILE.png", help="draw blocks in use per step, three ways")
    return p


def demo_requests(tokenizer: Tokenizer, args: argparse.Namespace) -> list[RequestSpec]:
    """The scenario's requests, as token ids."""

    def encode(text: str, bos: bool = True) -> list[int]:
        prefix = [tokenizer.bos_token_id] if bos and tokenizer.bos_token_id is not None else []
        return prefix + tokenizer.encode(text)

    def chat(question: str) -> list[int]:
        return encode(f"{SYSTEM_PROMPT}User: {question}\nAssistant:")

    n = args.max_new_tokens
    sampling = SamplingParams(args.samples, args.temperature, args.top_p, args.seed)
    return [
        RequestSpec("greedy", chat("What is a paged KV cache?"), n),
        RequestSpec("samples", chat("Name three uses of prefix caching."), n, sampling),
        RequestSpec("beam", chat("Summarise copy-on-write in one line."), n, beam_width=args.beam_width),
        RequestSpec("turn-2", encode("\nUser: And why share blocks between requests?\nAssistant:", bos=False), n, follows="greedy"),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or ensure_tiny_llama(args.model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, DTYPES[args.dtype])
    tokenizer = load_tokenizer(model_dir, model.config)
    c = model.config
    kv_dtype = canonical_dtype(args.kv_dtype or args.dtype)
    layout = PoolLayout(c.num_layers, c.num_kv_heads, c.head_dim, args.block_size, args.num_blocks, kv_dtype)
    specs = demo_requests(tokenizer, args)
    print(f"model {model_dir}: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_q_heads} q / {c.num_kv_heads} kv heads, head_dim {c.head_dim}")
    print(f"pool: {layout.num_blocks} blocks x {layout.block_size} tokens, {layout.total_bytes / 2**20:.1f} MiB of {kv_dtype}, in a server process")
    with ServerProcess(layout) as address, RadixKVClient(address) as client, PoolView.from_client(client) as view:
        print(f"server at {address}; worker maps the pool ({view.info.device}); session {client.session_id}\n")
        orchestrator = Orchestrator(client, Worker(model, view, args.backend), c.eos_token_ids, on_step=lambda r: print(format_step(r)))
        results = orchestrator.run(specs)
        stats = client.stats()
    print()
    if not args.model:
        print("(the embedded model has seeded random weights: its text is noise; what it shares is the point)")
    for spec, result in zip(specs, results, strict=True):
        for i, output in enumerate(result.outputs):
            score = f" (log p {result.scores[i]:.2f})" if result.scores else ""
            print(f"{spec.name}[{i}]{score}: {tokenizer.decode(output)!r}")
    print()
    print(format_requests(specs, results))
    print()
    print(format_memory(MemorySummary.of(orchestrator.steps, layout)))
    print(f"\nserver after the run: {stats.num_blocks_free} blocks free, {stats.num_blocks_cached} cached, "
          f"{stats.num_live_sequences} live sequences; prefix hits {stats.num_hit_tokens}/{stats.num_requested_tokens} prompt tokens")
    if args.plot:
        plot_blocks(orchestrator.steps, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
