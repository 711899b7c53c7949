"""The kernels, their tests and the GPU check import torch, triton, numpy and the kernels' own modules, nothing more.

A lent GPU machine has an image's Python with torch, triton and numpy, no network, and radixkv not installed;
`benchmarks/gpu_check.sh` runs there from the checkout through the stand-in package in `benchmarks/from_checkout`.
This test does what that machine does: a child process with that stand-in first on its path, where every other
package the project depends on (grpc, protobuf, cbor2, msgpack, sortedcontainers, ... read from pyproject.toml,
less torch's, triton's and pytest's own requirements) and every module of radixkv but the kernels raise
ImportError (here the editable install would find them; there nothing is installed), imports every module
of `kernels/`, every module of `tests/kernels/` as pytest would, and the benchmark scripts the GPU check runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = ("torch", "triton", "numpy", "pytest")  # pytest: the runner the tests are written for
SCRIPTS = ("gpu_check.py", "kernel_resources.py", "bench_paged_decode_attention.py", "bench_swap_blocks.py")

CHILD = """
import importlib.abc, importlib.util, pathlib, sys
blocked, root, extra = set(sys.argv[1].split(",")), pathlib.Path(sys.argv[2]), sys.argv[3:]

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top, _, rest = name.partition(".")
        core = top == "radixkv" and rest and not rest.startswith("kernels")  # radixkv is not installed there
        if top in blocked or core:
            raise ModuleNotFoundError(f"{name} is not on a bare GPU image", name=name)
        return None

sys.meta_path.insert(0, Blocked())
sys.path.insert(0, str(root / "benchmarks"))  # as running a script from benchmarks/ has it
import radixkv.kernels
for path in sorted((root / "kernels").glob("*.py")):
    importlib.import_module(f"radixkv.kernels.{path.stem}" if path.stem != "__init__" else "radixkv.kernels")
files = [root / "tests" / "conftest.py", *sorted((root / "tests" / "kernels").glob("*.py"))]
files += [root / "benchmarks" / name for name in SCRIPTS] + [pathlib.Path(p) for p in extra]
for path in files:
    spec = importlib.util.spec_from_file_location(f"closure_{path.parent.name}_{path.stem}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look themselves up there
    spec.loader.exec_module(module)
stray = sorted(m for m in sys.modules if m.split(".")[0] == "radixkv" and not m.startswith("radixkv.kernels"))
assert stray == ["radixkv"], f"modules of radixkv beyond the kernels were loaded: {stray}"
print(f"ok: {len(files)} files")
""".replace("SCRIPTS", repr(SCRIPTS))


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _requirements_of(dists: tuple[str, ...]) -> set[str]:
    """The distributions `dists` need, transitively (those installed here)."""
    found, todo = set(), list(dists)
    while todo:
        dist = todo.pop()
        if dist in found:
            continue
        found.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return found


def blocked_modules() -> list[str]:
    """Top-level modules of every installed distribution the project depends on but a bare GPU image lacks."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    missing = {_name(r) for r in wanted} - _requirements_of(ALLOWED)
    return sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if any(_name(d) in missing for d in dists) and module.isidentifier()
    )


def run_child(tmp_path: Path, *extra: Path) -> subprocess.CompletedProcess:
    path = [str(ROOT / "benchmarks" / "from_checkout"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(blocked_modules()), str(ROOT), *map(str, extra)],
        cwd=tmp_path,  # not the checkout: a path entry of the checkout's root would find the real radixkv/
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_blocked_set_holds_the_project_dependencies_a_gpu_image_lacks():
    """Those installed here: on a bare image (where this also runs) they are absent, and so unimportable anyway."""
    blocked = set(blocked_modules())
    names = ("grpc", "google", "cbor2", "msgpack", "sortedcontainers")
    assert {name for name in names if importlib.util.find_spec(name) is not None} <= blocked
    assert not blocked & {"torch", "triton", "numpy", "pytest", "jinja2"}, "torch's own requirements stay importable"


def test_kernels_tests_and_gpu_check_import_nothing_else(tmp_path):
    result = run_child(tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-4000:]


def test_a_stray_import_fails_the_check(tmp_path):
    """The check can fail: a module importing cbor2, or the core, is caught."""
    for body in ("import cbor2\n", "from radixkv.sequences.handoff import StepArrays\n"):
        planted = tmp_path / "planted.py"
        planted.write_text(body)
        result = run_child(tmp_path, planted)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, body
