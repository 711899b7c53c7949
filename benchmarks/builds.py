"""Before and after from one run: a benchmark script run once per build, the builds alternated round by round.

A build is a directory holding an installed radixkv (`pip install --no-deps --target DIR .` of another commit);
`None` is the radixkv this Python imports. Each run is its own process started outside any checkout (cwd `/`),
with the build's directory first on its path, so the script measures that build's code and nothing else of the
run differs. Runs minutes apart on a shared machine meet different loads: alternating the builds and keeping
each one's best round leaves the load to both alike.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_alternately(script: Path, builds: dict[str, str | None], argv: list[str], rounds: int) -> dict[str, list[dict]]:
    """`script argv --out F` once per build per round (the order reversed every other round); each run's JSON."""
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    order = list(builds)
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                out = Path(scratch) / f"{name}-{r}.json"
                env = dict(os.environ)
                if builds[name] is not None:
                    env["PYTHONPATH"] = os.path.abspath(str(builds[name]))
                print(f"== round {r + 1} of {rounds}: {name}", flush=True)
                command = [sys.executable, str(script.resolve()), *argv, "--out", str(out)]
                subprocess.run(command, env=env, cwd="/", check=True, stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(out.read_text()))
    return runs


def flatten(results: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves by dotted path (`requests.16.radixkv.cpu_s`)."""
    flat: dict[str, float] = {}
    for key, value in results.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[path] = float(value)
    return flat


def best(runs: list[dict], patterns: dict[str, str]) -> dict[str, float]:
    """Each metric matched by `patterns` (glob -> "lower" or "higher" is better) at its best over the runs."""
    merged: dict[str, float] = {}
    for run in map(flatten, runs):
        for path, value in run.items():
            better = next((way for glob, way in patterns.items() if fnmatch.fnmatchcase(path, glob)), None)
            if better is None:
                continue
            pick = min if better == "lower" else max
            merged[path] = pick(merged.get(path, value), value)
    return merged


def compare_table(before: dict[str, float], after: dict[str, float], names: tuple[str, str]) -> str:
    """One row per metric both builds reported: before, after, after / before."""
    rows = [(path, before[path], after[path]) for path in before if path in after]
    width = max((len(path) for path, _, _ in rows), default=10)
    lines = [f"{'metric':<{width}}  {names[0]:>12}  {names[1]:>12}  after/before", "-" * (width + 44)]
    for path, old, new in rows:
        ratio = f"{new / old:.3f}" if old else "-"
        lines.append(f"{path:<{width}}  {old:>12.6g}  {new:>12.6g}  {ratio:>12}")
    return "\n".join(lines)
