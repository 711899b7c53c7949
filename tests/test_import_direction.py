"""Imports point downward: core < storage < kernels; core < client, server < demo; read statically from the source.

Every `import` counts, in a function or under `if TYPE_CHECKING:` alike: a lazy import is still a dependency.
The layers, bottom up:
- core: `radixkv/*.py` except the upper modules below. No torch, triton or grpc, no wire code, nothing above.
- storage (`radixkv/memory/storage.py` and the modules it is built from: `pool_handle`, `shm_segment`, `cuda_ipc`,
  `memory_sizing`): the pool's memory, torch. Below the kernels, the server and the client.
- kernels: torch, triton, numpy and themselves, nothing else of radixkv (not even the core), so a bare GPU image
  runs them from a checkout (`benchmarks/gpu_check.sh`; tests/kernels/test_import_closure.py checks the rest).
- client, server: not each other.
- demo: the top, with the CLI (`radixkv/cli.py`), which reaches the others only by name (`radixkv serve`).
- integrations (`integrations/vllm` -> `radixkv.vllm`): beside the demo at the top; nothing below imports them.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kernels": "kernels", "server": "server", "client": "client", "demo": "demo", "integrations": "integrations"}
INTEGRATIONS = {"vllm"}  # radixkv.<name> packages mapped from integrations/<name>
# Modules of the radixkv/ folder outside the core -> layer (dotted names under radixkv)
UPPER_MODULES = {
    "memory.storage": "storage",
    "memory.pool_handle": "storage",
    "memory.shm_segment": "storage",
    "memory.cuda_ipc": "storage",
    "memory.memory_sizing": "storage",
    "cli": "cli",
}
WIRE = "wire"  # radixkv.v1, the generated protobuf code
# Inside server/ and client/, bottom up: a subpackage imports only those before it (their flat modules are unordered).
SUBPACKAGES = {
    "server": ["events", "keeper", "rules", "wire", "process"],
    "client": ["worker", "fleet", "session"],
}

# What each layer must not import (a layer name, or a top-level third-party package).
FORBIDDEN: dict[str, set[str]] = {
    "core": {"torch", "triton", "grpc", WIRE, "storage", "kernels", "server", "client", "demo", "cli", "integrations"},
    "storage": {"grpc", "kernels", "server", "client", "demo", "cli", "integrations"},
    "kernels": {"core", "storage", WIRE, "server", "client", "demo", "cli", "grpc", "integrations"},
    "client": {"server", "kernels", "demo", "cli", "integrations"},
    "server": {"client", "demo", "cli", "integrations"},
    "demo": {"cli", "integrations"},
    "cli": {"integrations"},
    "integrations": {"demo", "cli"},
}


def _inner_name(parts: tuple[str, ...]) -> str:
    """`memory.storage` for radixkv/memory/storage.py, `tree` for radixkv/tree/__init__.py."""
    names = list(parts)
    names[-1] = names[-1].removesuffix(".py")
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def layer_of_file(root: Path, path: Path) -> str | None:
    """The layer a source file belongs to, or None for what is not the package (tests, benchmarks, generated code)."""
    parts = path.relative_to(root).parts
    if parts[0] in FOLDERS:
        return FOLDERS[parts[0]]
    if parts[0] == "radixkv" and len(parts) >= 2 and parts[1] != "v1":
        return UPPER_MODULES.get(_inner_name(parts[1:]), "core")
    return None


def layer_of_module(name: str) -> str:
    """The layer of an imported module: a radixkv layer, or the top-level package name of anything else."""
    parts = name.split(".")
    if parts[0] != "radixkv" or len(parts) == 1:
        return parts[0]
    if parts[1] in FOLDERS:
        return FOLDERS[parts[1]]
    if parts[1] in INTEGRATIONS:
        return "integrations"
    if parts[1] == "v1":
        return WIRE
    inner = ".".join(parts[1:])
    for module, layer in UPPER_MODULES.items():
        if inner == module or inner.startswith(module + "."):
            return layer
    return "core"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import; `from radixkv import kernels` counts as `radixkv.kernels`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "radixkv":
                found += [(node.lineno, f"radixkv.{alias.name}") for alias in node.names]
    return found


def package_files(root: Path) -> list[Path]:
    return sorted(p for folder in ("radixkv", *FOLDERS) for p in (root / folder).rglob("*.py"))


def violations(root: Path) -> list[str]:
    """`path:line: layer imports module` for each import against the direction."""
    found = []
    for path in package_files(root):
        layer = layer_of_file(root, path)
        if layer is None:
            continue
        for line, module in imported_modules(path.read_text()):
            if layer_of_module(module) in FORBIDDEN[layer]:
                found.append(f"{path.relative_to(root)}:{line}: {layer} imports {module}")
    return found


def subpackage_violations(root: Path) -> list[str]:
    """`path:line: server.wire imports server.process.app` for each import up the SUBPACKAGES order."""
    found = []
    for folder, order in SUBPACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).parts
            if len(parts) < 2:
                continue  # a flat module
            rank = order.index(parts[0])
            for line, module in imported_modules(path.read_text()):
                names = module.split(".")
                if names[:2] != ["radixkv", folder] or len(names) < 3 or names[2] not in order:
                    continue
                if order.index(names[2]) > rank:
                    found.append(f"{path.relative_to(root)}:{line}: {folder}.{parts[0]} imports {module}")
    return found


def test_imports_point_downward() -> None:
    assert violations(ROOT) == []


def test_server_and_client_subpackages_import_downward() -> None:
    assert subpackage_violations(ROOT) == []


def test_every_subpackage_has_its_place() -> None:
    """A new subpackage of server/ or client/ joins SUBPACKAGES (and docs/architecture.md's table)."""
    for folder, order in SUBPACKAGES.items():
        found = {p.parent.name for p in (ROOT / folder).glob("*/__init__.py")}
        assert found == set(order), folder


def test_every_layer_is_read() -> None:
    """The walk sees the package: each layer has files (a rename cannot make the check vacuous)."""
    layers = {layer_of_file(ROOT, p) for p in package_files(ROOT)}
    assert set(FORBIDDEN) <= layers


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checker_reports_planted_violations(tmp_path: Path) -> None:
    _plant(
        tmp_path,
        {
            "radixkv/pool_stats.py": "import numpy as np\nfrom radixkv.errors import OutOfBlocks\n",  # fine
            "radixkv/bad_core.py": "import torch\n\ndef f():\n    from radixkv import server\n",
            "radixkv/typed_core.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import grpc\n",
            "radixkv/wire_core.py": "from radixkv.v1 import kvcache_pb2\n",
            # fine: storage may
            "radixkv/memory/storage.py": "import torch\nfrom radixkv.memory.layout import PoolLayout\n",
            "kernels/k.py": "import triton\nfrom radixkv.demo.model import Llama\n",
            "kernels/k2.py": "import numpy as np\nfrom radixkv.sequences.handoff import StepArrays\n",  # the core
            "client/c.py": "from radixkv.v1 import kvcache_pb2\nimport radixkv.server.process.app\n",
            "server/s.py": (
                "import grpc\nfrom radixkv.memory.storage import KVStorage\nfrom radixkv.client import PoolView\n"
            ),
            # fine
            "demo/d.py": "from radixkv.server.process.app import serve\nfrom radixkv.client import RadixKVClient\n",
            "integrations/vllm/v.py": "import vllm\nfrom radixkv.client import PoolView\n",  # fine
            "server/t.py": "from radixkv.vllm.plan import StepPlan\n",
            "tests/test_x.py": "import torch\nimport radixkv.server\n",  # not the package
        },
    )
    assert violations(tmp_path) == [
        "client/c.py:2: client imports radixkv.server.process.app",
        "kernels/k.py:2: kernels imports radixkv.demo.model",
        "kernels/k2.py:2: kernels imports radixkv.sequences.handoff",
        "radixkv/bad_core.py:1: core imports torch",
        "radixkv/bad_core.py:4: core imports radixkv.server",
        "radixkv/typed_core.py:3: core imports grpc",
        "radixkv/wire_core.py:1: core imports radixkv.v1",
        "server/s.py:3: server imports radixkv.client",
        "server/t.py:1: server imports radixkv.vllm.plan",
    ]


def test_the_checker_reports_a_subpackage_importing_upward(tmp_path: Path) -> None:
    _plant(
        tmp_path,
        {
            "server/rules/step.py": "from radixkv.server.events.hub import EventHub\n",  # fine: below
            "server/rules/checks.py": "def f():\n    from radixkv.server.wire import status\n",
            "server/flat.py": "from radixkv.server.process.app import main\n",  # flat: unordered
            "client/worker/pool_view.py": "from radixkv.client.session.client import RadixKVClient\n",
            "client/session/client.py": "from radixkv.client.worker.pool_view import PoolView\n",  # fine
        },
    )
    assert subpackage_violations(tmp_path) == [
        "server/rules/checks.py:2: server.rules imports radixkv.server.wire",
        "client/worker/pool_view.py:1: client.worker imports radixkv.client.session.client",
    ]


def test_mypy_strict_flags_cover_every_core_module() -> None:
    """pyproject.toml spells out the strict section (radixkv/**.py but the torch-bound storage layer).

    A new module must join it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = [o for o in config["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1, "one strict section, for the core"
    names = {
        _inner_name(p.relative_to(ROOT / "radixkv").parts)
        for p in (ROOT / "radixkv").rglob("*.py")
        if layer_of_file(ROOT, p) in ("core", "cli")
    }
    assert set(strict[0]["module"]) == {f"radixkv.{n}" if n else "radixkv" for n in names}
