"""Memory pressure: the pressure matrix through the core on a pool holding 25% of each scenario's working set.

Scenarios (benchmarks/pressure_trace.py): short/long prompt x short/long output, multi-turn chats whose
conversations come back after other traffic, and RAG over shared documents. Each is served to completion
by a small continuous-batching loop (benchmarks/pressure_loop.py) under each policy
(benchmarks/pressure_policies.py), in one run:
  - no host tier: on OutOfBlocks the orchestrator releases the latest arrival without caching and
    re-opens it later, recomputing what the tree no longer holds (radixkv before issue 11);
  - preempt by recompute: admission by token budget, the core's victims preempted by recompute (their
    computed blocks published to the tree) and resumed under their ids, re-matching what is still cached;
  - swap with a host tier 4x the pool: the same, the victims swapped to the host tier and back, and
    prefixes the device evicts written back to the host tier and loaded back on a hit.

Reported per scenario and policy: prefill tokens computed, and of them recomputed (computed before in
the run); device and host hit ratios of new requests; preemptions; blocks and bytes moved between device
and host; and a projected cost of what differs between policies, prefill compute against PCIe transfers,
for Llama-3-8B on an H100 (a model, not a measurement). Decode work is the same under every policy.

    python benchmarks/bench_pressure.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from radixkv.planning.model_shape import MODEL_SHAPES
from radixkv.planning.plan import GIB, plan_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pressure_trace  # noqa: E402 - sibling scripts, not a package
from pressure_loop import Counters, Scheduler  # noqa: E402
from pressure_policies import HOST_FACTOR, NoHostTier, Policy, PreemptRecompute, PreemptSwap  # noqa: E402

BLOCK_SIZE = 16
POOL_FRACTION = 0.25  # of each scenario's working set

# The cost model: Llama-3-8B in bfloat16 on an H100 SXM, its KV moved over PCIe.
MODEL = "llama-3-8b"
NUM_PARAMS = 8.03e9
NUM_Q_HEADS = 32
PEAK_FLOPS = 989e12  # H100 SXM, dense BF16
PREFILL_UTILIZATION = 0.5  # of the peak a long prefill reaches
PCIE_BYTES_PER_S = 50e9
COST_NOTE = (
    f"projected cost: a model, not a measurement: {MODEL} bf16 prefill at {PREFILL_UTILIZATION:.0%} of an H100 "
    f"SXM's {PEAK_FLOPS / 1e12:.0f} TFLOP/s (2 x params + attention FLOPs per token), KV over PCIe at "
    f"{PCIE_BYTES_PER_S / 1e9:.0f} GB/s; decode is the same under every policy and left out"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    sizes: pressure_trace.Sizes
    max_num_seqs: int
    max_batch_tokens: int


QUICK = Settings(pressure_trace.QUICK, max_num_seqs=32, max_batch_tokens=4096)
FULL = Settings(pressure_trace.FULL, max_num_seqs=64, max_batch_tokens=8192)


def policies() -> list[Policy]:
    return [NoHostTier(), PreemptRecompute(), PreemptSwap()]


def bytes_per_block() -> int:
    """KV bytes of one block of the cost model's model, by `radixkv plan`'s arithmetic."""
    plan = plan_capacity(MODEL_SHAPES[MODEL], device_memory_bytes=80 * GIB, block_size=BLOCK_SIZE, dtype="bfloat16")
    return plan.bytes_per_block


def projected_cost(c: Counters) -> dict[str, float]:
    """Seconds of prefill compute and of PCIe transfer the run's counters imply on the modelled hardware."""
    shape = MODEL_SHAPES[MODEL]
    # Attention: QK^T and AV, 2 FLOPs per multiply-add, per layer and query head, over each token's position.
    flops = 2 * NUM_PARAMS * c.num_prefill_tokens + 4 * shape.num_layers * NUM_Q_HEADS * shape.head_dim * (
        c.prefill_positions_sum
    )
    moved = (c.num_offloaded_blocks + c.num_loaded_blocks) * bytes_per_block()
    prefill_s = flops / (PEAK_FLOPS * PREFILL_UTILIZATION)
    pcie_s = moved / PCIE_BYTES_PER_S
    return {"prefill_s": prefill_s, "pcie_s": pcie_s, "total_s": prefill_s + pcie_s, "bytes_moved": moved}


def run_one(policy: Policy, requests: list[pressure_trace.TraceRequest], num_blocks: int, s: Settings) -> dict:
    cache = policy.make_cache(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(
        cache,
        policy,
        max_num_seqs=s.max_num_seqs,
        max_batch_tokens=s.max_batch_tokens,
        num_trace_tokens=sum(r.num_tokens for r in requests),
    )
    started = time.perf_counter()
    c = scheduler.run(requests)
    seconds = time.perf_counter() - started
    cache.check_invariants()
    assert not cache.sequence_ids(), "the loop released every sequence"
    expected = sum(len(r.output) for r in requests)
    assert c.num_generated_tokens == expected, "every output token generated once"
    revisit_missed = c.num_revisit_prior_tokens - c.num_revisit_device_hit_tokens
    return {
        **dataclasses.asdict(c),
        "device_hit_ratio": c.num_device_hit_tokens / max(1, c.num_prompt_tokens),
        "host_hit_ratio": c.num_host_hit_tokens / max(1, c.num_prompt_tokens),
        "revisit_host_hit_ratio": c.num_revisit_host_hit_tokens / revisit_missed if revisit_missed > 0 else None,
        "cost": projected_cost(c),
        "replay_seconds": seconds,
    }


def run_all(settings: Settings, seed: int = 0) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for name, requests in pressure_trace.scenarios(settings.sizes, seed).items():
        working_set = pressure_trace.working_set_blocks(requests, BLOCK_SIZE)
        largest = max(-(-r.num_tokens // BLOCK_SIZE) for r in requests)
        num_blocks = max(int(POOL_FRACTION * working_set), largest + 2)
        rows[name] = {
            "num_requests": len(requests),
            "working_set_blocks": working_set,
            "num_blocks": num_blocks,
            "host_num_blocks": HOST_FACTOR * num_blocks,
            "policies": {p.name: run_one(p, requests, num_blocks, settings) for p in policies()},
        }
    return {"rows": rows, "targets": targets(rows), "bytes_per_block": bytes_per_block(), "cost_note": COST_NOTE}


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets as this run's figures: with the host tier, multi-turn prefill recomputation at most
    half of what it is without one, and a host-tier hit ratio of at least 0.8 on revisited conversations."""
    multi_turn = rows["multi-turn"]["policies"]
    base, swap = multi_turn[NoHostTier.name], multi_turn[PreemptSwap.name]
    halved = swap["num_recomputed_tokens"] / max(1, base["num_recomputed_tokens"])
    revisit = swap["revisit_host_hit_ratio"] or 0.0
    return {
        "multi-turn recomputed, host tier / none (<= 0.5)": {"value": halved, "met": halved <= 0.5},
        "multi-turn revisit host-tier hit ratio (>= 0.8)": {"value": revisit, "met": revisit >= 0.8},
    }


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'scenario':<24} {'policy':<38} {'prefill':>9} {'recomp':>9} {'dev hit':>7} {'host hit':>8} "
        f"{'revisit':>7} {'preempt':>7} {'offload':>7} {'load':>7} {'GB moved':>8} {'prefill s':>9} {'PCIe s':>7} "
        f"{'cost s':>7}"
    )
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        for policy, r in row["policies"].items():
            cost = r["cost"]
            revisit = "-" if r["revisit_host_hit_ratio"] is None else f"{r['revisit_host_hit_ratio']:.2f}"
            lines.append(
                f"{name:<24} {policy:<38} {r['num_prefill_tokens']:>9,} {r['num_recomputed_tokens']:>9,} "
                f"{r['device_hit_ratio']:>7.2f} {r['host_hit_ratio']:>8.2f} {revisit:>7} {r['num_preemptions']:>7} "
                f"{r['num_offloaded_blocks']:>7} {r['num_loaded_blocks']:>7} {cost['bytes_moved'] / 1e9:>8.2f} "
                f"{cost['prefill_s']:>9.2f} {cost['pcie_s']:>7.2f} {cost['total_s']:>7.2f}"
            )
    return "\n".join(lines + [LEGEND])


LEGEND = (
    "prefill: tokens prefills computed; recomp: of them, tokens computed before in the run; dev hit / host hit: of new "
    "requests' prompt tokens, the share the device held / the host tier loaded back; revisit: of what a revisited "
    "conversation had computed before and the device no longer held, the share the host tier served; offload / "
    "load: blocks device -> host (write-back, swap out) / host -> device (load-back, swap in)"
)


def ratio(value: float, base: float) -> str:
    return f"x{value / base:.2f}" if base else "n/a (both 0)" if not value else "inf"


def format_ratios(rows: dict[str, dict[str, Any]]) -> str:
    """Each policy against no host tier: recomputed prefill tokens and projected cost, as ratios."""
    lines = []
    for name, row in rows.items():
        results = list(row["policies"].items())
        _, base = results[0]
        for policy, r in results[1:]:
            recomputed = ratio(r["num_recomputed_tokens"], base["num_recomputed_tokens"])
            cost = ratio(r["cost"]["total_s"], base["cost"]["total_s"])
            lines.append(f"{name:<24} {policy:<38} recomputed {recomputed}, projected cost {cost}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller scenarios (under 30 s)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    started = time.perf_counter()
    result = run_all(settings, args.seed)
    rows = result["rows"]
    print(
        f"block size {BLOCK_SIZE}; pool {POOL_FRACTION:.0%} of each scenario's working set, host tier "
        f"{HOST_FACTOR}x the pool; at most {settings.max_num_seqs} sequences and {settings.max_batch_tokens} "
        f"tokens per step; {MODEL} KV block {result['bytes_per_block'] / 2**20:.0f} MiB\n"
    )
    for name, row in rows.items():
        print(
            f"{name:<24} {row['num_requests']:>4} requests, working set {row['working_set_blocks']:>6,} blocks, "
            f"pool {row['num_blocks']:>5,}, host tier {row['host_num_blocks']:>6,}"
        )
    print()
    print(format_table(rows))
    ratios = format_ratios(rows)
    if ratios:
        print("\nagainst no host tier:\n" + ratios)
    for target, t in result["targets"].items():
        print(f"target: {target}: {t['value']:.3f} {'met' if t['met'] else 'NOT MET'}")
    print(f"\n{COST_NOTE}")
    print(f"replayed in {time.perf_counter() - started:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": dataclasses.asdict(settings), **result}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
