"""benchmarks/bench_swap_blocks.py --quick runs end to end: it checks the bytes it moved, and writes its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_swap_blocks.py"


def test_quick_run_writes_every_case(tmp_path: Path) -> None:
    out = tmp_path / "swap.json"
    # As a user runs it on a CPU machine: without the Triton interpreter the suite sets (tests/conftest.py), which
    # would time the interpreted kernel (10 s of CPU for no figure). The kernel's bytes under the interpreter are
    # tests/kernels/test_swap_blocks.py's, and gpu_check's smoke runs this benchmark's cases interpreted.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    command = [sys.executable, str(BENCH), "--quick", "--repeats", "1", "--out", str(out)]
    subprocess.run(command, check=True, env=env, timeout=600)  # a hang guard only
    rows = json.loads(out.read_text())["rows"]
    assert {(r["direction"], r["num_blocks"]) for r in rows} == {(d, n) for d in ("offload", "load") for n in (16, 64)}
    for r in rows:
        assert r["bytes"] == r["num_blocks"] * 4 * 2 * 16 * 8 * 128 * 2  # 4 layers' K and V of fp16 blocks
        assert all(gb > 0 for gb in r["gb_per_s"].values())
