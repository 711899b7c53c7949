"""`bench_fleet.py --quick` end to end: 4 real servers, the three policies and a kill. Asserts what the
cache does (hits, failures, routing), never a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.server.process.spawn import patient

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fleet.py"


def test_quick_fleet_run_routes_to_the_cache_and_never_to_the_dead(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=patient(240)
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "router" in run.stdout and "hit ratio" in run.stdout, "the table is printed"
    result = json.loads(out.read_text())
    policies = result["policies"]
    assert all(p["num_failed"] == 0 for name, p in policies.items() if name != "router_kill")
    # Releases cache what each turn wrote: the single cache hits most of a multi-turn trace, and routing by
    # the index keeps most of that where random placement loses it.
    assert policies["single"]["hit_ratio"] > 0.8
    assert policies["router"]["hit_ratio"] > 1.5 * policies["random"]["hit_ratio"]
    assert policies["router"]["hit_ratio"] <= policies["single"]["hit_ratio"] + 1e-9
    assert result["targets"]["none routed to the dead instance after its health check failed"]
