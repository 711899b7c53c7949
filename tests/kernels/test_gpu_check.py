"""benchmarks/gpu_check.sh: its CPU smoke mode runs every section through the same code a GPU run takes, prints one
table and writes one JSON file; a failing check is its own row; the interpreter is the one running these tests."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
KERNELS = ("store_kv", "copy_blocks", "swap_blocks", "paged_decode_attention")


def run_script(tmp_path: pathlib.Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess:
    # PYTHON: this interpreter, not whatever python3 comes first on the PATH. From tmp_path: the script must not
    # depend on the working directory.
    env = dict(os.environ, PYTHON=sys.executable, **env_vars)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run the script itself, not its smoke mode")
def test_smoke_mode_prints_one_table_and_writes_its_rows(tmp_path):
    out = tmp_path / "check.json"
    result = run_script(tmp_path, "--smoke", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "smoke" and report["ok"] is True
    assert f"Python {sys.version.split()[0]}" in report["environment"], "the script ran another interpreter"
    rows = report["rows"]
    status = {(r["section"], r["check"]): r["status"] for r in rows}
    assert {r["section"] for r in rows} == {"correctness", "sync", "ipc", "swap", "bandwidth", "tests"}
    assert not [r for r in rows if r["status"] in ("FAIL", "ERROR")]
    for kernel in KERNELS:
        for kv in ("float16", "fp8"):
            checks = [c for (section, c), s in status.items() if c.startswith(f"{kernel} {kv}") and s == "ok"]
            assert checks, f"no passing correctness row for {kernel} {kv}"
    assert status[("correctness", "bfloat16 kernels")] == "skip"  # the interpreter has no bfloat16
    assert all(s == "skip" for (section, _), s in status.items() if section in ("sync", "ipc"))  # they need CUDA
    decode = [r for r in rows if r["section"] == "bandwidth"]
    assert {r["check"].rsplit(" ", 1)[1] for r in decode} == {"float16", "fp8"} and all(r["us"] > 0 for r in decode)
    assert all(r["peak_fraction"] is None for r in decode), "CPU figures are not bandwidth figures"
    pytest_row = next(r for r in rows if r["section"] == "tests")
    assert pytest_row["status"] == "ok" and " 0 failed" in pytest_row["figure"]
    assert result.stdout.count("section ") == 1, "one table"


def test_usage_errors_and_no_device(tmp_path):
    assert run_script(tmp_path, "--bogus").returncode == 2
    assert run_script(tmp_path, "--smoke", "--sections", "correctness,bogus").returncode == 2
    if not torch.cuda.is_available():
        result = run_script(tmp_path, "--out", str(tmp_path / "x.json"))
        assert result.returncode == 2 and "--smoke" in result.stderr
        assert not (tmp_path / "x.json").exists()


def test_sections_past_the_budget_are_not_started(tmp_path):
    out = tmp_path / "check.json"
    result = run_script(tmp_path, "--smoke", "--budget-s", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["status"] == "skip" and "not started" in r["figure"] for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode")
def test_a_section_that_dies_is_its_own_row_and_the_next_one_runs(tmp_path):
    """A real crash: the ipc section's process exits at start-up (a sitecustomize on its path sees to that)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\nif sys.argv[1:3] == ['--section', 'ipc']:\n    os._exit(3)\n"
    )
    out = tmp_path / "check.json"
    result = run_script(tmp_path, "--smoke", "--sections", "ipc,swap", "--out", str(out), PYTHONPATH=str(hook))
    assert result.returncode == 1, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["section"], r["status"]) for r in rows if r["section"] == "ipc"] == [("ipc", "ERROR")]
    assert rows[0]["figure"].startswith("exit 3")
    assert [r["status"] for r in rows if r["section"] == "swap"] == ["skip", "ok", "ok"]


def test_a_failing_check_is_its_own_row_and_the_section_goes_on():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    rows = gpu_check.Rows("correctness")
    with rows.check("first"):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with rows.check("second"):
        rows.add("second", "bit-exact")
    assert [(r["check"], r["status"]) for r in rows] == [("first", "ERROR"), ("second", "ok")]
    assert rows[0]["figure"].startswith("RuntimeError: CUDA error") and "Traceback" in rows[0]["trace"]
