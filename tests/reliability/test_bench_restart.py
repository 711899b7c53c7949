"""`bench_restart.py --quick` end to end: a keeper, servers upgraded and crashed. Asserts what the cache does
(hits after the restart, prefill a crash costs), never a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.server.process.spawn import patient

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_restart.py"


def test_quick_restart_run_keeps_the_hits_through_an_upgrade_and_loses_them_in_a_crash(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=patient(300)
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "to serving s" in run.stdout and "prefill tokens the upgrade saves" in run.stdout, "the table is printed"
    result = json.loads(out.read_text())
    scenarios = {s["scenario"]: s for s in result["scenarios"]}
    assert result["ratios"]["upgrade_over_none_hit_after"] >= 0.95
    assert scenarios["upgrade"]["num_adopted_blocks"] > 0 and scenarios["upgrade"]["snapshot_bytes"] > 0
    assert scenarios["crash"]["num_adopted_blocks"] == 0, "a crash adopts nothing"
    assert scenarios["crash"]["prefill_tokens_after"] > scenarios["upgrade"]["prefill_tokens_after"]
