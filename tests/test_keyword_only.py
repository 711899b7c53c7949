"""Records and constructors with more than three fields are built with keywords (issue 41).

A call `Thing(a, b, c, d, e)` reads only beside the definition, and a field inserted in the middle silently
shifts every later argument. So in product code a dataclass with more than three init fields is
`kw_only=True` (or puts them after `KW_ONLY`), a NamedTuple has at most three fields, and an `__init__`
takes at most three positional parameters after `self` (the natural ones: `KVStorage(layout, data, scales,
*, ...)`). An exception names its class and says why below; a stale exception fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_FOLDERS = ("radixkv", "server", "client", "integrations", "kernels", "demo")
MAX_POSITIONAL = 3

# "path:Class" -> why it may be built positionally. Keep it short: "hot path" needs a measured cost.
EXCEPTIONS: dict[str, str] = {}


def _decorator(cls: ast.ClassDef, name: str) -> ast.expr | None:
    for d in cls.decorator_list:
        if ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] == name:
            return d
    return None


def _keyword(call: ast.expr, name: str) -> bool:
    return isinstance(call, ast.Call) and any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords
    )


def _positional_fields(cls: ast.ClassDef) -> int:
    """The dataclass's or NamedTuple's own fields that `__init__` takes positionally."""
    count = 0
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        annotation = ast.unparse(stmt.annotation)
        if annotation.split(".")[-1] == "KW_ONLY":
            break  # the fields after the sentinel are keyword-only
        if "ClassVar" in annotation:
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
            if any(
                k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords
            ):
                continue
            if _keyword(value, "kw_only"):
                continue
        count += 1
    return count


def positional_constructors(root: Path) -> list[str]:
    """`path:line:Class (what)` for each record or constructor taking more than three arguments positionally."""
    found = []
    for folder in PRODUCT_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for cls in ast.walk(tree):
                if not isinstance(cls, ast.ClassDef):
                    continue
                where = f"{path.relative_to(root)}:{cls.lineno}:{cls.name}"
                dataclass = _decorator(cls, "dataclass")
                if any(ast.unparse(b).split(".")[-1] == "NamedTuple" for b in cls.bases):
                    n = _positional_fields(cls)
                    if n > MAX_POSITIONAL:
                        found.append(f"{where} (NamedTuple, {n} fields)")
                elif dataclass is not None:
                    if not (_keyword(dataclass, "kw_only") or _positional_fields(cls) <= MAX_POSITIONAL):
                        found.append(f"{where} (dataclass, {_positional_fields(cls)} positional fields)")
                for init in cls.body:
                    if isinstance(init, ast.FunctionDef) and init.name in ("__init__", "__new__"):
                        n = len(init.args.posonlyargs) + len(init.args.args) - 1  # less self / cls
                        if n > MAX_POSITIONAL or init.args.vararg is not None:
                            found.append(f"{where} ({init.name}, {n} positional parameters)")
    return found


def test_records_and_constructors_with_more_than_three_fields_are_keyword_only() -> None:
    found = positional_constructors(ROOT)
    unexplained = [f for f in found if f.split(":")[0] + ":" + f.split(":")[2].split(" ")[0] not in EXCEPTIONS]
    assert unexplained == []


def test_every_exception_is_still_needed() -> None:
    found = {f.split(":")[0] + ":" + f.split(":")[2].split(" ")[0] for f in positional_constructors(ROOT)}
    assert sorted(set(EXCEPTIONS) - found) == []


def test_each_positional_form_is_found(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "m.py").write_text(
        "import dataclasses\n"
        "from typing import NamedTuple, ClassVar\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class A:\n    a: int\n    b: int\n    c: int\n    d: int\n"
        "@dataclasses.dataclass(kw_only=True)\n"
        "class B:\n    a: int\n    b: int\n    c: int\n    d: int\n"
        "@dataclasses.dataclass\n"
        "class C:\n    a: int\n    b: int\n    c: int\n    _: dataclasses.KW_ONLY\n    d: int\n"
        "    e: ClassVar[int] = 0\n"
        "class D(NamedTuple):\n    a: int\n    b: int\n    c: int\n    d: int\n"
        "class E:\n    def __init__(self, a, b, c, d): pass\n"
        "class F:\n    def __init__(self, a, b, c, *, d): pass\n"
        "class G:\n    def __init__(self, *args): pass\n"
    )
    assert [f.split(" ")[0] for f in positional_constructors(tmp_path)] == [
        "server/m.py:4:A",
        "server/m.py:23:D",
        "server/m.py:28:E",
        "server/m.py:32:G",
    ]
