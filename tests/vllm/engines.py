"""Running tests/vllm/engine_run.py: one vLLM engine per process, as the tests and benchmarks/bench_vllm.py do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from radixkv.server.process.spawn import patient

HERE = Path(__file__).resolve().parent


ENGINE_SECONDS = 900.0  # an engine's start and a few prompts: about a minute on an idle 2-core machine


def run_engine(out: Path, model: Path, *flags: str, timeout: float = ENGINE_SECONDS) -> dict:
    """tests/vllm/engine_run.py in a fresh process (an engine of its own); its JSON. The bound stretches with the
    machine's load (`patient`). The engine runs at the priority of everything else: lowered (it was `nice -n 5`),
    a machine's other work at normal priority starved it (an engine's start took over half an hour beside eight
    busy loops)."""
    command = [sys.executable, str(HERE / "engine_run.py"), str(out), "--model", str(model), *flags]
    log = out.with_suffix(".log")
    with log.open("wb") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=patient(timeout), check=False)
    assert done.returncode == 0, log.read_text()[-3000:]
    return json.loads(out.read_text())
