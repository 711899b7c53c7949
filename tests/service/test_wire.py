"""The wire contract's artefacts: generated code matches proto/, buf lint passes, the client stays torch-free."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "radixkv" / "v1"


def test_committed_generated_code_matches_the_protos(tmp_path: Path) -> None:
    subprocess.run(
        [str(ROOT / "proto" / "generate.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )
    fresh = tmp_path / "radixkv" / "v1"
    generated_names = sorted(p.name for p in fresh.iterdir())
    committed_names = sorted(p.name for p in GENERATED.iterdir() if "_pb2" in p.name)
    assert generated_names == committed_names, "a .proto was added or removed: run proto/generate.sh"
    assert {"kvcache_pb2.py", "kvcache_pb2_grpc.py", "kvcache_pb2.pyi"} <= set(generated_names)
    stale = [name for name in generated_names if not filecmp.cmp(fresh / name, GENERATED / name, shallow=False)]
    assert stale == [], f"stale generated code {stale}: run proto/generate.sh"


def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf")
    if buf is None:
        pytest.skip("buf is not installed (npm install -g @bufbuild/buf)")
    result = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import radixkv.client, sys; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
