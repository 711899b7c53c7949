"""Running tests/vllm/engine_run.py: one vLLM engine per process, as the tests and benchmarks/bench_vllm.py do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_engine(out: Path, model: Path, *flags: str, timeout: float = 1200) -> dict:
    """tests/vllm/engine_run.py in a fresh process (an engine of its own), at a lower priority; its JSON.
    `timeout`: generous, an engine starts in 30-60 s on 2 idle cores and in minutes on a loaded machine."""
    command = ["nice", "-n", "5", sys.executable, str(HERE / "engine_run.py"), str(out), "--model", str(model), *flags]
    log = out.with_suffix(".log")
    with log.open("wb") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    assert done.returncode == 0, log.read_text()[-3000:]
    return json.loads(out.read_text())
