"""benchmarks/kernel_resources.py compiles the decode kernels for sm_90 on any machine: the fp8 path's resource use,
read from the compiled kernels, is what issue 34 asked for (no byte-wide V reads, fp16's register budget)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_resources.py"


NO_CUDA_BACKEND = importlib.util.find_spec("triton.backends.nvidia") is None


@pytest.mark.skipif(NO_CUDA_BACKEND, reason="triton without its CUDA backend (and its ptxas)")
def test_quick_table_from_the_compiled_kernels(tmp_path):
    out = tmp_path / "resources.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CTA/SM" in result.stdout
    rows = {r["kv_dtype"]: r for r in json.loads(out.read_text())["rows"] if r["kernel"] == "decode_split_kernel"}
    fp16, fp8 = rows["float16"], rows["fp8"]
    assert fp8["byte_shared_loads"] == 0, "fp8 V is read from shared memory a byte at a time again"
    assert fp16["spill_store_bytes"] == fp8["spill_store_bytes"] == 0
    assert fp8["registers"] <= 128, "fp8 needs more registers than 4 programs per SM allow on sm_90"
    assert fp8["ctas_per_sm"] >= fp16["ctas_per_sm"] >= 3
