"""Only grpcio's public API: no product module reaches into gRPC's private modules or private attributes.

A module built on `grpc._*`, `cygrpc` or a private attribute of a gRPC object (a handler's
`_replace`, a channel's `_channel`, a request iterator's `_call`) breaks with any grpcio release;
the project pins only lower bounds. Read statically from every product module's syntax tree:
  - an import of a private gRPC module (`grpc._server`, `from grpc import _common`, `grpc._cython`),
    or any mention of `cygrpc` (a name, an attribute, or a string, as `importlib.import_module` takes it);
  - in a module that imports gRPC (`grpc`, `grpc.aio`, `grpc_health`, `grpc_reflection`,
    `grpc_status`): an underscore attribute of anything but `self` or `cls` (`obj._x`, `self._x._y`),
    read, written, or named to `getattr`/`hasattr`/`setattr`/`delattr`. There a gRPC object may be
    any value, so only a module's own attributes (`self._x`) are allowed.
Generated code (`radixkv/v1/*_pb2*.py`, written by grpcio-tools, which owns its version check) is aside.
The checker is proved on planted modules: each kind of reach-in is found, a clean module passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_FOLDERS = ("radixkv", "server", "client", "kernels", "demo", "integrations")
GRPC_PACKAGES = ("grpc", "grpc_health", "grpc_reflection", "grpc_status")
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_grpc_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] in GRPC_PACKAGES and any(_private(p) or p == "cygrpc" for p in parts[1:])


def _imports_grpc(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in GRPC_PACKAGES for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in GRPC_PACKAGES:
            return True
    return False


def violations(source: str, name: str) -> list[str]:
    """Each reach into gRPC's private API in `source`, as "name:line: what"."""
    tree = ast.parse(source)
    grpc_module = _imports_grpc(tree)
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{name}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(f"{name}:{node.lineno}: import {a.name}" for a in node.names if _private_grpc_module(a.name))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _private_grpc_module(module):
                flag(node, f"from {module} import ...")
            elif module.split(".")[0] in GRPC_PACKAGES:
                for alias in node.names:
                    if _private(alias.name) or alias.name == "cygrpc":
                        flag(node, f"from {module} import {alias.name}")
        elif isinstance(node, ast.Name) and node.id == "cygrpc":
            flag(node, "cygrpc")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "cygrpc" in node.value or _private_grpc_module(node.value.strip()):
                flag(node, f"the string {node.value[:40]!r}")
        elif isinstance(node, ast.Attribute):
            if node.attr == "cygrpc" or (
                isinstance(node.value, ast.Name) and node.value.id in GRPC_PACKAGES and _private(node.attr)
            ):
                flag(node, ast.unparse(node))
            elif (
                grpc_module
                and _private(node.attr)
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                flag(node, f"private attribute {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and grpc_module:
            func = node.func
            if isinstance(func, ast.Name) and func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2:
                target, attribute = node.args[0], node.args[1]
                own = isinstance(target, ast.Name) and target.id in ("self", "cls")
                if (
                    isinstance(attribute, ast.Constant)
                    and isinstance(attribute.value, str)
                    and _private(attribute.value)
                ):
                    if not own:
                        flag(node, f"{func.id}(..., {attribute.value!r})")
    return found


def product_modules() -> list[Path]:
    modules = [p for folder in PRODUCT_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in modules if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def test_no_product_module_uses_grpc_internals() -> None:
    modules = product_modules()
    assert len(modules) > 100, "the walk found the product modules"
    found = [v for path in modules for v in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "\n".join(found)


PLANTED = {
    "import grpc._server\n": "import grpc._server",
    "from grpc._cython import cygrpc\n": "from grpc._cython import",
    "from grpc import _common\n": "from grpc import _common",
    "import importlib\ncy = importlib.import_module('grpc._cython.cygrpc')\n": "the string",
    "import grpc\ndef f(h: grpc.RpcMethodHandler):\n    return h._replace(unary_unary=None)\n": "h._replace",
    "import grpc\ndef f(channel: grpc.Channel):\n    return channel._channel.segregated_call\n": "channel._channel",
    "import grpc\ndef f(requests):\n    return getattr(requests, '_call', None)\n": "getattr(..., '_call')",
    "import grpc\nclass S:\n    def f(self):\n        return self._responses._state\n": "self._responses._state",
    "import asyncio\nimport grpc.aio\ndef f(future):\n    future._asyncio_future_blocking = False\n": "future._asyncio",
    "import grpc\nx = grpc._server\n": "grpc._server",
}


@pytest.mark.parametrize("source", PLANTED, ids=list(PLANTED.values()))
def test_the_checker_finds_each_planted_reach_in(source: str, tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    found = violations(planted.read_text(), "planted.py")
    assert found and any(PLANTED[source] in v for v in found), found


def test_the_checker_passes_public_use_and_a_modules_own_attributes() -> None:
    clean = (
        "import grpc\n"
        "class Stream:\n"
        "    def __init__(self, channel: grpc.Channel) -> None:\n"
        "        self._channel = channel\n"
        "        self._calls = grpc.stream_stream_rpc_method_handler(lambda r, c: r)\n"
        "    def code(self) -> str:\n"
        "        return self._channel.__class__.__name__ + str(grpc.StatusCode.OK) + str(getattr(self, '_calls'))\n"
    )
    assert violations(clean, "clean.py") == []
    assert violations("def f(obj):\n    return obj._private\n", "no_grpc.py") == [], "a module without gRPC is not read"
