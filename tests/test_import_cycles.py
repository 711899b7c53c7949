"""No import cycle of any kind: between modules, and between the packages that group them.

The graph is read statically from every import statement of the product folders (`radixkv/`, `server/`,
`client/`, `kernels/`, `demo/`, `integrations/`), in a function or under `if TYPE_CHECKING:` alike: a lazy or type-only
import is still a dependency, and a cycle held together by one is still a cycle (docs/design.md: if two modules
need each other, they are one concept or an interface is missing). Generated protobuf code is left out.

An edge goes from a module to each module it names: `from radixkv.tree import radix_tree` and
`from radixkv.tree.radix_tree import Node` both reach `radixkv.tree.radix_tree`. Importing a module also runs
its parents' `__init__`, but those edges are not counted: `radixkv/__init__.py` re-exports the core's public
names, so counting them would put every core module in one cycle with it. Its own imports count like any
module's.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"radixkv": "radixkv", "server": "radixkv.server", "client": "radixkv.client",
           "kernels": "radixkv.kernels", "demo": "radixkv.demo", "integrations": "radixkv"}  # fmt: skip
# integrations/vllm installs as radixkv.vllm (pyproject.toml's package-dir)


def module_name(root: Path, path: Path) -> str | None:
    """The dotted name a product file imports as (None: generated code)."""
    parts = list(path.relative_to(root).parts)
    if parts[0] == "radixkv" and len(parts) > 1 and parts[1] == "v1":
        return None
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


def product_modules(root: Path) -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            name = module_name(root, path)
            if name is not None:
                modules[name] = path
    return modules


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each product module -> the product modules its import statements name (every statement, at any depth)."""
    modules = product_modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


GROUPED = ("radixkv.server", "radixkv.client")  # folders grouped one level deeper: their subpackages are the units


def package_of(module: str) -> str:
    """The package a module is grouped in: `radixkv.tree` for `radixkv.tree.radix_tree`, `radixkv.server.rules`
    for `radixkv.server.rules.step`; a module directly in `radixkv/`, `server/` or `client/` (`radixkv.kv_cache`,
    `radixkv.client.errors`) is its own unit, as is each package itself."""
    parts = module.split(".")
    depth = 3 if ".".join(parts[:2]) in GROUPED else 2
    return ".".join(parts[:depth]) if len(parts) > depth else module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        packages.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    return packages


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its nodes in import order, the first repeated at the end), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        cycle: list[str] = e.args[1]
        return list(reversed(cycle))
    return None


def test_no_module_imports_itself_through_others() -> None:
    assert find_cycle(import_graph(ROOT)) is None


def test_no_package_imports_itself_through_others() -> None:
    assert find_cycle(package_graph(import_graph(ROOT))) is None


def test_the_graph_reads_the_product() -> None:
    """The walk sees the package and its edges (a rename cannot make the checks vacuous)."""
    graph = import_graph(ROOT)
    assert "radixkv.kv_cache" in graph and "radixkv.server.rules.service" in graph and "radixkv.client" in graph
    assert "radixkv.kv_cache" in graph["radixkv.server.rules.pools"]
    assert not any(name.startswith("radixkv.v1") for name in graph)
    packages = package_graph(graph)
    assert {"radixkv.server.rules", "radixkv.server.wire", "radixkv.client.session"} <= set(packages)
    assert "radixkv.server.rules" in packages["radixkv.server.wire"]


def test_server_and_client_subpackages_are_units() -> None:
    assert package_of("radixkv.server.rules.step") == "radixkv.server.rules"
    assert package_of("radixkv.server.rules") == "radixkv.server.rules"
    assert package_of("radixkv.client.errors") == "radixkv.client.errors"
    assert package_of("radixkv.tree.radix_tree") == "radixkv.tree"


def _plant(root: Path, files: dict[str, str]) -> None:
    for folder in FOLDERS:
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_cycle_held_by_a_type_only_or_lazy_import_is_found(tmp_path: Path) -> None:
    _plant(
        tmp_path,
        {
            "radixkv/__init__.py": "from radixkv.kv_cache import KVCache\n",
            "radixkv/kv_cache.py": "from radixkv.tree.radix_tree import RadixTree\n",
            "radixkv/tree/__init__.py": "",
            "radixkv/tree/radix_tree.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from radixkv.tree.host_tier import HostTier\n",
            "radixkv/tree/host_tier.py": "def load():\n    from radixkv.tree import radix_tree\n",
            "server/process/app.py": "import radixkv.kv_cache\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["radixkv.tree.radix_tree"] == {"radixkv.tree.host_tier"}
    assert graph["radixkv.tree.host_tier"] == {"radixkv.tree", "radixkv.tree.radix_tree"}
    assert find_cycle(graph) in (
        ["radixkv.tree.radix_tree", "radixkv.tree.host_tier", "radixkv.tree.radix_tree"],
        ["radixkv.tree.host_tier", "radixkv.tree.radix_tree", "radixkv.tree.host_tier"],
    )
    # Inside one package that is no cycle between packages.
    assert find_cycle(package_graph(graph)) is None


def test_a_cycle_between_packages_is_found_where_modules_have_none(tmp_path: Path) -> None:
    _plant(
        tmp_path,
        {
            "radixkv/tree/pins.py": "from radixkv.sequences.admission import num_newly_locked\n",
            "radixkv/tree/radix_tree.py": "",
            "radixkv/sequences/admission.py": "from radixkv.tree.radix_tree import RadixTree\n",
            "client/session/client.py": "from radixkv.tree.pins import Pins\n",
        },
    )
    graph = import_graph(tmp_path)
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) in (
        ["radixkv.sequences", "radixkv.tree", "radixkv.sequences"],
        ["radixkv.tree", "radixkv.sequences", "radixkv.tree"],
    )
    assert package_graph(graph)["radixkv.client.session"] == {"radixkv.tree"}
