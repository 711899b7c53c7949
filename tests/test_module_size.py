"""Every module of the core package stays under 300 lines: one concept per module (STYLE.md, habit 1).

Generated protobuf code (`radixkv/v1/*_pb2*`) is not written by hand and is exempt.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300


def oversized_modules(root: Path) -> list[str]:
    """`path: N lines` for each hand-written module under radixkv/ with MAX_LINES lines or more."""
    found = []
    for path in sorted((root / "radixkv").rglob("*.py")):
        if "_pb2" in path.name:
            continue
        num_lines = len(path.read_text().splitlines())
        if num_lines >= MAX_LINES:
            found.append(f"{path.relative_to(root)}: {num_lines} lines")
    return found


def test_every_core_module_is_under_300_lines() -> None:
    assert oversized_modules(ROOT) == []


def test_the_check_reports_a_long_module_and_skips_generated_code(tmp_path: Path) -> None:
    (tmp_path / "radixkv" / "v1").mkdir(parents=True)
    (tmp_path / "radixkv" / "short.py").write_text("x = 1\n" * (MAX_LINES - 1))
    (tmp_path / "radixkv" / "long.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "radixkv" / "v1" / "kvcache_pb2.py").write_text("x = 1\n" * 1000)
    assert oversized_modules(tmp_path) == ["radixkv/long.py: 300 lines"]


def test_every_integration_module_is_at_most_400_lines() -> None:
    """`integrations/` (radixkv.vllm) holds product modules: at most 400 lines each (STYLE.md, habit 1)."""
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted((ROOT / "integrations").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert long == []
