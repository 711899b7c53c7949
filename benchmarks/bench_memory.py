"""KV memory of parallel sampling and beam search: radixkv against contiguous slabs and unshared paging.

Model-free: seeded request traces with ShareGPT-like and Alpaca-like length distributions replay
through the core `KVCache` as a serving scheduler would drive it (open, fork samples or beams,
append one token per live sequence per step, prune beams, release). After every step the same live
sequences are charged three ways, and the sums over steps compared as ratios within the run:

- radixkv: the pool's blocks in use (`stats().num_blocks_in_use`), prompts and beam prefixes shared;
- paged without sharing: every sequence its own `ceil(num_tokens / block_size)` blocks;
- contiguous: every sequence a slab of `prompt + max_new_tokens` slots reserved up front.

Utilisation is the share of charged slots that hold a token's K/V (radixkv counts a shared token
once). Savings are `1 - radixkv / baseline`. The PagedAttention paper (Kwon et al., SOSP 2023, Fig. 15)
reports 6.1-9.8% savings from sharing for parallel sampling and 37.6-55.2% for beam search on Alpaca.

    python benchmarks/bench_memory.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import numpy as np

from radixkv import KVCache

BLOCK_SIZES = (1, 8, 16, 32)
MODES: tuple[tuple[str, int], ...] = (
    ("sample", 1),
    ("sample", 2),
    ("sample", 4),
    ("sample", 6),
    ("beam", 2),
    ("beam", 4),
    ("beam", 6),
)
VOCAB = 32000
PAPER_BLOCK_SIZE = 16  # the paper's default
PAPER_SAVINGS = {"sample": (6.1, 9.8), "beam": (37.6, 55.2)}  # percent, Alpaca, against paging without sharing


@dataclasses.dataclass(frozen=True, slots=True)
class TraceShape:
    """Log-normal prompt and output lengths with the given means (before clipping to `max_new_tokens`)."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float
    max_prompt_tokens: int
    max_new_tokens: int  # the request's limit: what a contiguous slab must reserve for the output


# Means from the PagedAttention paper's Fig. 11 (ShareGPT 161/338, Alpaca 19/58 tokens); spreads chosen
# to give ShareGPT its long tail and Alpaca its short, narrow instructions.
TRACES = {
    "sharegpt": TraceShape(161.0, 1.0, 338.0, 0.8, 2048, 1024),
    "alpaca": TraceShape(19.0, 0.6, 58.0, 0.7, 256, 256),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    prompt: np.ndarray  # int32 [prompt_len]
    output_lens: tuple[int, ...]  # one per sample; beams share one length


def make_requests(shape: TraceShape, num_requests: int, mode: str, width: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)

    def lengths(mean: float, sigma: float, cap: int, size: int) -> np.ndarray:
        mu = math.log(mean) - sigma**2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
        return np.clip(np.rint(rng.lognormal(mu, sigma, size)), 1, cap).astype(int)

    requests = []
    for prompt_len in lengths(shape.prompt_mean, shape.prompt_sigma, shape.max_prompt_tokens, num_requests):
        num_outputs = width if mode == "sample" else 1
        outputs = lengths(shape.output_mean, shape.output_sigma, shape.max_new_tokens, num_outputs)
        requests.append(Request(rng.integers(0, VOCAB, prompt_len, dtype=np.int32), tuple(int(n) for n in outputs)))
    return requests


@dataclasses.dataclass(slots=True)
class _Seq:
    seq_id: int
    num_tokens: int
    last_block: int
    target_len: int  # total tokens at which this sequence ends


@dataclasses.dataclass(slots=True)
class Usage:
    """Slots summed over steps (slot-steps), per scheme; `*_filled` are the slots holding K/V."""

    num_steps: int = 0
    radixkv: int = 0
    radixkv_filled: int = 0
    paged: int = 0
    contiguous: int = 0
    tokens: int = 0  # logical tokens of the live sequences: what paged and contiguous hold
    peak_radixkv: int = 0
    peak_paged: int = 0
    peak_contiguous: int = 0
    num_cow_copies: int = 0


def replay(
    requests: list[Request], mode: str, width: int, block_size: int, max_new_tokens: int, max_live: int, seed: int
) -> Usage:
    """Drive `KVCache` through the requests, at most `max_live` requests at a time; charge every step."""
    rng = np.random.default_rng(seed)
    max_len = max(len(r.prompt) for r in requests) + max_new_tokens
    num_blocks = 2 * max_live * width * -(-max_len // block_size) + 64
    kv = KVCache(num_blocks, block_size)
    usage = Usage()
    queue = list(reversed(requests))
    live: list[tuple[Request, list[_Seq]]] = []
    while queue or live:
        while queue and len(live) < max_live:
            request = queue.pop()
            opened = kv.open(request.prompt)
            parent = _Seq(opened.seq_id, len(request.prompt), int(opened.block_table[-1]), 0)
            # The prompt's K/V are written by the prefill; then the samples (or the first beams) fork from it.
            kv.commit([opened.seq_id], [len(request.prompt)])
            forks = kv.fork(parent.seq_id, width - 1) if width > 1 else []
            seqs = [parent] + [dataclasses.replace(parent, seq_id=s) for s in forks]
            lens = request.output_lens if mode == "sample" else request.output_lens * width
            for seq, n in zip(seqs, lens, strict=True):
                seq.target_len = len(request.prompt) + n
            live.append((request, seqs))
        if mode == "beam":
            for i, (request, beams) in enumerate(live):
                if beams[0].num_tokens > len(request.prompt):  # past the first step: survivors replace beams
                    live[i] = (request, _next_beams(kv, beams, rng))
        seqs = [s for _, group in live for s in group]
        tokens = rng.integers(0, VOCAB, (len(seqs), 1), dtype=np.int32)
        for seq, result in zip(
            seqs, kv.append_many(list(zip([s.seq_id for s in seqs], tokens, strict=True))), strict=True
        ):
            seq.num_tokens = result.num_tokens
            seq.last_block = result.block_ids[-1] if result.block_ids else seq.last_block
            usage.num_cow_copies += len(result.copies)
        _charge(usage, kv, live, block_size, max_new_tokens)
        still_live = []
        for request, group in live:
            done = [s for s in group if s.num_tokens >= s.target_len]
            kv.release_many([s.seq_id for s in done], cache=False)
            if len(done) < len(group):
                still_live.append((request, [s for s in group if s.num_tokens < s.target_len]))
        live = still_live
    kv.check_invariants()
    assert kv.stats().num_blocks_in_use == 0, "bench: a released sequence still holds blocks"
    return usage


def _next_beams(kv: KVCache, beams: list[_Seq], rng: np.random.Generator) -> list[_Seq]:
    """Beam search's pattern with random survivors: each of `width` slots picks a parent beam; a parent
    picked c times lives on as itself plus c - 1 forks; a parent never picked is pruned."""
    counts = np.bincount(rng.integers(0, len(beams), len(beams)), minlength=len(beams))
    kv.release_many([b.seq_id for b, c in zip(beams, counts, strict=True) if c == 0], cache=False)
    survivors = []
    for beam, c in zip(beams, counts, strict=True):
        if c:
            survivors.append(beam)
            if c > 1:
                survivors += [dataclasses.replace(beam, seq_id=s) for s in kv.fork(beam.seq_id, int(c) - 1)]
    return survivors


def _charge(
    usage: Usage, kv: KVCache, live: list[tuple[Request, list[_Seq]]], block_size: int, max_new_tokens: int
) -> None:
    seqs = [(request, s) for request, group in live for s in group]
    in_use = kv.stats().num_blocks_in_use * block_size
    # Every block in use is full except the sequences' last blocks; a last block shared by several
    # sequences counts once.
    unfilled = {s.last_block: block_size - s.num_tokens % block_size for _, s in seqs if s.num_tokens % block_size}
    paged = sum(-(-s.num_tokens // block_size) * block_size for _, s in seqs)
    contiguous = sum(len(r.prompt) + max_new_tokens for r, _ in seqs)
    usage.num_steps += 1
    usage.radixkv += in_use
    usage.radixkv_filled += in_use - sum(unfilled.values())
    usage.paged += paged
    usage.contiguous += contiguous
    usage.tokens += sum(s.num_tokens for _, s in seqs)
    usage.peak_radixkv = max(usage.peak_radixkv, in_use)
    usage.peak_paged = max(usage.peak_paged, paged)
    usage.peak_contiguous = max(usage.peak_contiguous, contiguous)


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    trace: str
    mode: str
    width: int
    block_size: int
    util_contiguous: float
    util_paged: float
    util_radixkv: float
    saving_vs_contiguous: float  # percent of slot-steps
    saving_vs_paged: float
    peak_saving_vs_contiguous: float
    peak_saving_vs_paged: float
    num_cow_copies: int
    seconds: float


def measure(trace: str, mode: str, width: int, block_size: int, num_requests: int, max_live: int, seed: int) -> Row:
    shape = TRACES[trace]
    requests = make_requests(shape, num_requests, mode, width, seed)
    start = time.perf_counter()
    u = replay(requests, mode, width, block_size, shape.max_new_tokens, max_live, seed + 1)
    return Row(
        trace,
        mode,
        width,
        block_size,
        util_contiguous=u.tokens / u.contiguous,
        util_paged=u.tokens / u.paged,
        util_radixkv=u.radixkv_filled / u.radixkv,
        saving_vs_contiguous=100 * (1 - u.radixkv / u.contiguous),
        saving_vs_paged=100 * (1 - u.radixkv / u.paged),
        peak_saving_vs_contiguous=100 * (1 - u.peak_radixkv / u.peak_contiguous),
        peak_saving_vs_paged=100 * (1 - u.peak_radixkv / u.peak_paged),
        num_cow_copies=u.num_cow_copies,
        seconds=time.perf_counter() - start,
    )


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'trace':<9} {'mode':<9} {'block':>5} | {'util contig':>11} {'util paged':>10} {'util radixkv':>12} | "
        f"{'saved vs contig':>15} {'saved vs paged':>14} | {'peak vs contig':>14} {'peak vs paged':>13} | {'cow':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.trace:<9} {f'{r.mode} {r.width}':<9} {r.block_size:>5} | {r.util_contiguous:>11.1%} "
            f"{r.util_paged:>10.1%} "
            f"{r.util_radixkv:>12.1%} | {r.saving_vs_contiguous:>14.1f}% {r.saving_vs_paged:>13.1f}% | "
            f"{r.peak_saving_vs_contiguous:>13.1f}% {r.peak_saving_vs_paged:>12.1f}% | {r.num_cow_copies:>6}"
        )
    return "\n".join(lines)


def paper_comparison(rows: list[Row]) -> str:
    """Where radixkv stands beside the PagedAttention paper's sharing savings (Alpaca, block size 16)."""
    lines = [
        f"beside the PagedAttention paper (alpaca, block size {PAPER_BLOCK_SIZE}, saving against paging without "
        "sharing):"
    ]
    for mode, (low, high) in PAPER_SAVINGS.items():
        ours = [
            r
            for r in rows
            if r.trace == "alpaca" and r.mode == mode and r.width > 1 and r.block_size == PAPER_BLOCK_SIZE
        ]
        if ours:
            measured = ", ".join(
                f"{'n' if mode == 'sample' else 'k'}={r.width}: {r.saving_vs_paged:.1f}%" for r in ours
            )
            lines.append(
                f"  {'parallel sampling' if mode == 'sample' else 'beam search':<17}  radixkv {measured}   paper "
                f"{low}-{high}%"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 30 s)")
    parser.add_argument("--out", metavar="FILE.json", help="write the rows and the settings as JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    num_requests = {"sharegpt": 8, "alpaca": 40} if args.quick else {"sharegpt": 96, "alpaca": 384}
    max_live = 8 if args.quick else 16
    rows = []
    for trace in TRACES:
        for mode, width in MODES:
            for block_size in BLOCK_SIZES:
                rows.append(measure(trace, mode, width, block_size, num_requests[trace], max_live, args.seed))
    print(format_table(rows))
    print()
    print(paper_comparison(rows))
    print(
        f"\n{sum(r.seconds for r in rows):.1f} s of replay; requests per run: {num_requests}, at most {max_live} live "
        "at once"
    )
    if args.out:
        settings = {
            "quick": args.quick,
            "seed": args.seed,
            "num_requests": num_requests,
            "max_live_requests": max_live,
            "traces": {name: dataclasses.asdict(shape) for name, shape in TRACES.items()},
        }
        with open(args.out, "w") as f:
            json.dump({"settings": settings, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
