"""`bench_kv_events.py --quick` end to end: a real server, quiet, beside a flood and under one. Asserts what the
stream delivers (every announcement, in every phase), never a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.server.process.spawn import patient

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kv_events.py"


def test_quick_run_announces_every_block_in_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "kv_events.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=patient(240)
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "flood elsewhere" in run.stdout and "lag_ms_p99" in run.stdout, "the table is printed"
    phases = json.loads(out.read_text())["phases"]
    assert set(phases) == {"quiet", "flood elsewhere", "flood"}
    for name, phase in phases.items():
        assert phase["num_announced"] > 0 and phase["num_missed"] == 0, name
    assert phases["flood"]["replay_requests_sent"] > 0 and phases["quiet"]["replay_requests_sent"] == 0
