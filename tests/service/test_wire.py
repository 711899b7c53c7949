"""The wire contract's artefacts: generated code matches proto/, buf lint and buf breaking pass, the client
stays torch-free."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

from radixkv.server.process.spawn import patient

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


def _buf() -> str:
    """The buf CLI from the `buf-bin` wheel of the test extra: beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "buf"
    found = str(beside) if beside.exists() else shutil.which("buf")
    assert found, "buf is missing: pip install buf-bin (radixkv's test extra brings it)"
    return found


def test_buf_lint_is_clean() -> None:
    result = subprocess.run([_buf(), "lint"], cwd=ROOT / "proto", capture_output=True, text=True, timeout=patient(120))
    assert result.returncode == 0, result.stdout + result.stderr


def test_wire_changes_are_additive_against_the_released_proto() -> None:
    """`buf breaking` against the image of the last released proto (refresh it with `make proto-baseline`)."""
    baseline = ROOT / "proto" / "baseline" / "radixkv-v0.1.binpb"
    result = subprocess.run(
        [_buf(), "breaking", "--against", str(baseline)],
        cwd=ROOT / "proto",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    """The check above can fail: a copy of proto/ with one field number changed is refused."""
    copy = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", copy)
    kvcache = copy / "radixkv" / "v1" / "kvcache.proto"
    text = kvcache.read_text()
    assert "uint64 seq_id = 1;" in text
    kvcache.write_text(text.replace("uint64 seq_id = 1;", "uint64 seq_id = 99;", 1))
    baseline = copy / "baseline" / "radixkv-v0.1.binpb"
    result = subprocess.run(
        [_buf(), "breaking", "--against", str(baseline)], cwd=copy, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "seq_id" in result.stdout + result.stderr


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import radixkv.client, sys; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(120))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
