"""`bench_step_ab.py` end to end: this checkout's server and clients beside bare gRPC, a round of each way.

Asserts what the figures rest on, not the figures: each build's worker imports the build it names (the
server it starts too, from a directory that shadows nothing), every way ran for each build that has
it, and the table says what radixkv adds over the floor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import radixkv
from radixkv.server.process.spawn import patient

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step_ab.py"


def test_a_round_of_each_way_against_bare_grpc(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    ways = "empty,empty_aio,decode,decode_unary,piped"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--build", "this=.", "--ways", ways, "--rounds", "1", "--per", "10",
         "--out", str(out)],
        capture_output=True, text=True, timeout=patient(240),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["sources"]["this"] == radixkv.__file__  # the build this test imports
    assert set(results["sources"]) == {"this", "bare"}
    for way in ways.split(","):
        assert results[way]["this"]["wall_p50_us"] > 0
        assert results[way]["this"]["server_cpu_us"] > 0  # the server applied the steps
    for way in ("empty", "empty_aio", "decode", "decode_unary"):
        assert results[way]["bare"]["wall_p50_us"] > 0
    assert "bare" not in results["piped"]  # bare gRPC has no pipelined steps to compare
    assert "over bare" in run.stdout
