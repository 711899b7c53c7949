"""Only the public API of every library we use: no product module reaches into another library's private parts.

A private name (a leading underscore; dunders aside) of torch, numpy, zmq, msgpack, prometheus_client, the standard
library or any other package may change in any release: the project pins only lower bounds. Read statically from
every product module's syntax tree (tests/test_public_grpc_api.py holds gRPC to a stricter rule of its own):
  - an import of another package's private module or name (`import torch._C`, `from torch._utils import x`,
    `from numpy import _core`), or a string naming one (`importlib.import_module("torch._C")`);
  - a private attribute on a chain from an imported name (`torch.cuda._sleep`, `torch.UntypedStorage._new_shared_cuda`),
    read, written, or named to `getattr`/`hasattr`/`setattr`/`delattr`;
  - a private attribute of any other object, `self` and `cls` included (`storage._share_cuda_()`, `shm._mmap`,
    `getattr(shm, "_fd")`, a Thread subclass's `self._target`), unless this codebase defines that name itself
    (`self._x = ...`, `def _x`, `_x = ...`, a class field `_x: T`): the object is then taken for one of ours,
    whose private parts our own modules may share;
  - a patch of another library: assigning or deleting an attribute of an imported module or object
    (`resource_tracker.register = ...`), directly or by `setattr`/`delattr`.
Generated code (`radixkv/v1/*_pb2*.py`, written by grpcio-tools) is aside. ALLOWED lists what had to stay, each with
its reason; an entry no longer needed fails the test too. The checker is proved on planted modules.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_FOLDERS = ("radixkv", "server", "client", "kernels", "demo", "integrations")
OWN_PACKAGES = {"radixkv"}  # server/, client/, kernels/ import as radixkv.server, radixkv.client, radixkv.kernels
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.\w+)+")

# "path: what the checker prints" -> why it stays (which public API is missing). Empty: nothing had to stay.
ALLOWED: dict[str, str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign(module: str) -> bool:
    return module.split(".")[0] not in OWN_PACKAGES


def _private_path(module: str) -> bool:
    return any(_private(part) for part in module.split("."))


def _a_library(name: str) -> bool:
    """Whether `name` is a top-level module this interpreter can import (`torch`, `os`), other than ours."""
    if not _foreign(name) or not name.isidentifier():
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def own_private_names(sources: Iterable[str]) -> set[str]:
    """Every private name the codebase defines: functions, classes, module and class variables, `self._x`/`cls._x`."""
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _root(node: ast.expr) -> ast.expr:
    """`torch` for `torch.cuda.Event()._x` and `torch.cuda._sleep`: the start of an attribute chain."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _dotted(node: ast.expr) -> bool:
    """Whether `node` is a plain `name.attr.attr` chain (no call or subscript on the way)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _imported_names(tree: ast.AST) -> set[str]:
    """The names a module binds to another package's modules and objects (`np`, `F`, `resource_tracker`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if _foreign(a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and _foreign(node.module or ""):
            names.update(a.asname or a.name for a in node.names)
    return names


def violations(source: str, name: str, own_names: set[str]) -> list[str]:
    """Each reach into another library's private parts in `source`, as "name:line: what"."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{name}:{getattr(node, 'lineno', 0)}: {what}")

    def foreign_root(node: ast.expr) -> bool:
        root = _root(node)
        return isinstance(root, ast.Name) and root.id in imported

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name) and _private_path(alias.name):
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and _foreign(node.module or ""):
            module = node.module or ""
            if _private_path(module):
                flag(node, f"from {module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    flag(node, f"from {module} import {alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            if MODULE_PATH.fullmatch(text) and _private_path(text) and _a_library(text.split(".")[0]):
                flag(node, f"the string {text!r}")
        elif isinstance(node, ast.Attribute):
            if _private(node.attr) and foreign_root(node.value):
                flag(node, f"private attribute {ast.unparse(node)}")
            elif _private(node.attr) and node.attr not in own_names:
                # on self or cls: inherited from a library's class (a Thread's `self._target`)
                flag(node, f"private attribute {ast.unparse(node)} (no module of ours defines {node.attr})")
            if isinstance(node.ctx, (ast.Store, ast.Del)) and _dotted(node.value) and foreign_root(node.value):
                flag(node, f"patches {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS:
            if len(node.args) < 2:
                continue
            target, attribute = node.args[0], node.args[1]
            if node.func.id in ("setattr", "delattr") and _dotted(target) and foreign_root(target):
                flag(node, f"patches {ast.unparse(target)} by {node.func.id}")
            if isinstance(attribute, ast.Constant) and isinstance(attribute.value, str) and _private(attribute.value):
                if foreign_root(target) or attribute.value not in own_names:
                    flag(node, f"{node.func.id}({ast.unparse(target)}, {attribute.value!r})")
    return found


def product_modules() -> list[Path]:
    modules = [p for folder in PRODUCT_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in modules if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def _without_line(violation: str) -> str:
    path, _line, what = violation.split(":", 2)
    return f"{path}:{what}"


def test_no_product_module_uses_another_librarys_private_parts() -> None:
    modules = product_modules()
    assert len(modules) > 100, "the walk found the product modules"
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in modules}
    own_names = own_private_names(sources.values())
    found = [_without_line(v) for name, source in sources.items() for v in violations(source, name, own_names)]
    assert not [v for v in found if v not in ALLOWED], "\n".join(v for v in found if v not in ALLOWED)
    assert not [a for a in ALLOWED if a not in found], f"ALLOWED entries no longer needed: {set(ALLOWED) - set(found)}"


PLANTED = {
    "import torch._C\n": "import torch._C",
    "from torch._utils import _rebuild_tensor\n": "from torch._utils import ...",
    "from numpy import _core\n": "from numpy import _core",
    "from multiprocessing.shared_memory import _USE_POSIX\n": "import _USE_POSIX",
    "import importlib\nC = importlib.import_module('torch._C')\n": "the string 'torch._C'",
    "import threading\nclass T(threading.Thread):\n    def f(self):\n        return self._target\n": "self._target",
    "import torch\ntorch.cuda._sleep(10)\n": "torch.cuda._sleep",
    "import torch\ns = torch.UntypedStorage._new_shared_cuda(0, b'')\n": "torch.UntypedStorage._new_shared_cuda",
    "import torch\ndef f(t: torch.Tensor):\n    return t.untyped_storage()._share_cuda_()\n": (
        "t.untyped_storage()._share_cuda_"
    ),
    "from multiprocessing import shared_memory\ndef f(shm: shared_memory.SharedMemory):\n    return shm._mmap\n": (
        "shm._mmap"
    ),
    "def f(shm):\n    return getattr(shm, '_fd')\n": "getattr(shm, '_fd')",
    "import zmq\ndef f(socket: zmq.Socket):\n    return socket._shadow_obj\n": "socket._shadow_obj",
    "import numpy as np\nx = np._NoValue\n": "np._NoValue",
    "from prometheus_client import REGISTRY\nnames = REGISTRY._names_to_collectors\n": "REGISTRY._names_to_collectors",
    "from multiprocessing import resource_tracker\nresource_tracker.register = lambda *a: None\n": (
        "patches resource_tracker.register"
    ),
    "import msgpack\nsetattr(msgpack, 'packb', None)\n": "patches msgpack by setattr",
    "import torch\nclass C:\n    def f(self):\n        return self.storage._weak_ref()\n": "self.storage._weak_ref",
}


@pytest.mark.parametrize("source", PLANTED, ids=list(PLANTED.values()))
def test_the_checker_finds_each_planted_reach_in(source: str, tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    found = violations(planted.read_text(), "planted.py", own_private_names([planted.read_text()]))
    assert found and any(PLANTED[source] in v for v in found), found


def test_the_checker_passes_public_use_and_our_own_private_parts() -> None:
    ours = (
        "class Pool:\n"
        "    _instances = 0\n"
        "    def __init__(self) -> None:\n"
        "        self._free = [1, 2]\n"
        "    def _check(self) -> None:\n"
        "        pass\n"
        "def _helper(pool: Pool) -> int:\n"
        "    return len(pool._free)\n"
    )
    user = (
        "import weakref\n"
        "import torch\n"
        "from torch.multiprocessing.reductions import reduce_tensor\n"
        "def f(pool, t: torch.Tensor) -> object:\n"
        "    pool._check()\n"
        "    weakref.finalize(t, print).atexit = False\n"  # a documented attribute of a finalizer, not a patch
        "    return reduce_tensor(t), torch.cuda.cudart(), getattr(pool, '_free'), t.__class__.__name__\n"
    )
    own_names = own_private_names([ours, user])
    assert own_names == {"_instances", "_free", "_check", "_helper"}
    assert violations(ours, "ours.py", own_names) == []
    assert violations(user, "user.py", own_names) == []


def test_our_own_private_name_on_a_library_chain_is_still_flagged() -> None:
    """A name we define (`_free`) does not make another library's attribute of that name ours."""
    source = "import torch\nclass P:\n    def __init__(self):\n        self._free = 1\nx = torch.cuda._free\n"
    assert violations(source, "p.py", own_private_names([source])) == ["p.py:5: private attribute torch.cuda._free"]
