"""docs/architecture.md's two tables stay true: the layers match the import test's, the errors match radixkv.errors.

Both are read from the Markdown, so a layer, package or error class added to the code without its row fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import radixkv.errors as errors
from radixkv.errors import RadixKVError

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _import_direction() -> ModuleType:
    """tests/test_import_direction.py, whose tables (`FORBIDDEN`, `FOLDERS`, `UPPER_MODULES`) the doc must match."""
    spec = importlib.util.spec_from_file_location("import_direction", ROOT / "tests" / "test_import_direction.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first Markdown table under `## heading`."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert len(lines) > 2 and set(lines[1]) <= set("|-: "), f"no table under {heading!r}"
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_layers_table_names_the_import_tests_layers_in_order() -> None:
    rows = table_rows(DOC.read_text(), "Layers and the import direction")
    names = [name.strip().lower() for row in rows for name in row[0].split(",")]
    assert names == list(_import_direction().FORBIDDEN)


def test_the_layers_table_puts_each_folder_and_module_in_its_layer() -> None:
    direction = _import_direction()
    where = {}
    for row in table_rows(DOC.read_text(), "Layers and the import direction"):
        for name in row[0].split(","):
            where[name.strip().lower()] = row[1]
    assert "`radixkv/`" in where["core"]
    for folder, layer in direction.FOLDERS.items():
        assert f"`{folder}/" in where[layer], (folder, layer)
    for package in direction.INTEGRATIONS:
        assert f"`radixkv.{package}`" in where["integrations"]
    for module, layer in direction.UPPER_MODULES.items():
        assert f"{module.rsplit('.', 1)[-1]}.py`" in where[layer], (module, layer)


def test_the_error_table_lists_every_error_class_with_its_reason_and_code() -> None:
    rows = table_rows(DOC.read_text(), "Errors: one table")
    table = {}
    for row in rows:
        found = re.match(r"`(\w+)`", row[0])
        assert found is not None, row
        assert found[1] not in table, f"{found[1]} has two rows"
        table[found[1]] = (row[1].strip("`"), row[2])
    # Every class radixkv.errors defines but the base, whose INTERNAL the prose above the table covers.
    classes = {
        name: cls
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, RadixKVError) and cls is not RadixKVError
    }
    assert len(classes) == len(errors.ERRORS_BY_REASON)  # the walk sees them all (tests/core/test_errors.py)
    assert sorted(table) == sorted(classes)
    assert table == {name: (cls.reason, cls.grpc_code) for name, cls in classes.items()}


HOP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def resolves(path: Path, qualname: str) -> bool:
    """A function or method (`Class.method`, nested classes too) defined at that path, read statically."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for i, name in enumerate(qualname.split(".")):
        found = [
            n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
        ]
        if not found:
            return False
        if i < len(qualname.split(".")) - 1:
            if not isinstance(found[0], ast.ClassDef):
                return False
            scope = found[0].body
    return True


def test_every_hop_names_a_function_that_exists() -> None:
    section = DOC.read_text().split("\n## One request, hop by hop\n", 1)[1].split("\n## ", 1)[0]
    hops = HOP.findall(section)
    assert len(hops) >= 25, "the three calls' hops are read"
    missing = [f"{file}:{name}" for file, name in hops if not (ROOT / file).exists() or not resolves(ROOT / file, name)]
    assert missing == []


def test_a_hop_that_names_nothing_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def f(self):\n        pass\n\ndef g():\n    pass\n")
    assert resolves(module, "A.f") and resolves(module, "g")
    assert not resolves(module, "A.h") and not resolves(module, "h") and not resolves(module, "g.f")
