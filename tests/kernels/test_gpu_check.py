"""benchmarks/gpu_check.sh: its CPU smoke mode runs the same steps and writes the one JSON file a GPU run would."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=dict(os.environ), capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run the script itself, not its smoke mode")
def test_smoke_mode_writes_one_json_file(tmp_path):
    out = tmp_path / "check.json"
    result = run_script("--smoke", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "smoke" and report["ok"] is True
    tests = report["tests"]
    assert tests["failed"] == tests["errors"] == 0 and tests["passed"] == 0
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "tests",
        ],
        cwd=SCRIPT.parents[1],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    num_gpu_tests = sum("::" in line for line in collected.splitlines())
    assert tests["skipped"] == num_gpu_tests >= 40, "every gpu-marked test ran (and skipped here)"
    bench = report["bench"]
    assert bench["bandwidth_figures"] is False and report["targets"] == []
    shapes = {(row["shape"], row["kv_dtype"]) for row in bench["rows"]}
    assert ("ragged 1x2k+7x128", "fp8") in shapes and ("ragged 1x2k+7x128", "float16") in shapes
    assert all(row["radixkv_us"] > 0 and row["path"] == "torch" for row in bench["rows"])
    assert "not bandwidth figures" in report["logs"]["bench"]


def test_usage_errors(tmp_path):
    assert run_script("--bogus").returncode == 2
    if not torch.cuda.is_available():
        result = run_script("--out", str(tmp_path / "x.json"))
        assert result.returncode == 2 and "--smoke" in result.stderr
        assert not (tmp_path / "x.json").exists()
