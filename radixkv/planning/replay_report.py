"""`radixkv replay`: every policy at every capacity on agent traces, next to LRU, MIN and an infinite cache.

Each (capacity, policy) replay is independent, so they run in worker processes (one per core by default).
The gap closed is (policy - LRU) / (MIN - LRU) at the same point: 0 is LRU, 1 is what knowing the future gives.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from radixkv.planning.trace_replay import load_sessions, next_uses, replay, schedule
from radixkv.tree.eviction import POLICIES

_state: dict[str, Any] = {}  # a worker's events and MIN's use lists, set before the pool forks


def parse_tokens(text: str) -> int:
    """'0.5M', '2M', '500k', '1048576' -> tokens (M = 10^6, k = 10^3)."""
    cleaned = text.strip().lower()
    factor = {"m": 10**6, "k": 10**3}.get(cleaned[-1:], 1)
    try:
        value = float(cleaned[:-1] if factor > 1 else cleaned) * factor
    except ValueError:
        raise ValueError(f"--capacity-tokens: not a token count: {text!r}") from None
    if value < 1024:
        raise ValueError(f"--capacity-tokens: at least 1024 tokens, got {text!r}")
    return int(value)


def _one(job: tuple[int | None, str, float]) -> float:
    capacity, policy, ttl_s = job
    return replay(_state["events"], capacity, policy, ttl_s=ttl_s, uses=_state.get("uses"))


def run(
    traces: str,
    concurrency: float,
    capacities: list[int],
    policy: str,
    *,
    ttl_s: float = 0.0,
    seed: int = 7,
    jobs: int = 0,
) -> dict[str, Any]:
    """Replay and return `{"points": [...], "infinite": h, "ttl": ..., "seconds": s}` (see `format_report`)."""
    started = time.perf_counter()
    policies = list(POLICIES) if policy == "all" else [policy]
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"--policy: unknown {name!r}; known: {', '.join(POLICIES)}, all")
    events = schedule(load_sessions(traces), concurrency, seed)
    _state["events"], _state["uses"] = events, next_uses(events)
    wanted = [*dict.fromkeys(["lru", "min", *policies])]
    grid = [(None, "lru", 0.0)] + [(c, p, 0.0) for c in capacities for p in wanted]
    if ttl_s:
        grid.append((None, "lru", ttl_s))
    workers = jobs or os.cpu_count() or 1
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_one, grid))
    else:
        results = [_one(job) for job in grid]
    _state.clear()
    by_job = dict(zip(grid, results, strict=True))
    points = []
    for c in capacities:
        hits = {p: by_job[(c, p, 0.0)] for p in wanted}
        hits["infinite"] = by_job[(None, "lru", 0.0)]
        if "agent" in hits:
            hits["default"] = hits["agent"]  # radixkv's policy for agent traffic
        points.append({"concurrency": concurrency, "capacity_tokens": c, "policies": hits})
    report = {"points": points, "seconds": time.perf_counter() - started, "num_requests": len(events)}
    if ttl_s:
        report["ttl"] = {"ttl_s": ttl_s, "infinite": by_job[(None, "lru", ttl_s)]}
    return report


def gap_closed(hits: dict[str, float], policy: str) -> float | None:
    """Of the LRU-to-MIN gap at one point, the share `policy` closes (None where there is no gap)."""
    gap = hits["min"] - hits["lru"]
    return (hits[policy] - hits["lru"]) / gap if gap > 1e-9 else None


def format_report(report: dict[str, Any]) -> str:
    points = report["points"]
    names = [p for p in points[0]["policies"] if p not in ("infinite", "default")] if points else []
    others = [p for p in names if p not in ("lru", "min")]
    header = f"{'K':>5} {'capacity':>10} {'infinite':>8} " + " ".join(f"{n:>7}" for n in names)
    header += "  " + " ".join(f"{'gap ' + n:>10}" for n in others)
    lines = [header]
    for point in points:
        hits = point["policies"]
        row = f"{point['concurrency']:>5g} {point['capacity_tokens']:>10,} {hits['infinite']:>8.3f} "
        row += " ".join(f"{hits[n]:>7.3f}" for n in names) + "  "
        row += " ".join(f"{'-' if (g := gap_closed(hits, n)) is None else f'{g:.0%}':>10}" for n in others)
        lines.append(row)
    if "ttl" in report:
        ttl = report["ttl"]
        lines.append(f"infinite cache with a {ttl['ttl_s']:g} s TTL refreshed on use: {ttl['infinite']:.3f}")
    lines.append(f"{report['num_requests']:,} requests; replayed in {report['seconds']:.1f} s")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump({k: v for k, v in report.items()}, f, indent=1)
        f.write("\n")
