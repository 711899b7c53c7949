"""The formatter formats: a `# fmt: skip` in product code needs its reason in a comment on the line above it.

Hand alignment that the formatter would undo is sometimes worth keeping (a table of cases, one per row); the
reason says which. Issue 41 removed every bare one (the formatter formats those lines now).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_FOLDERS = ("radixkv", "server", "client", "kernels", "demo", "integrations")


def bare_fmt_skips(root: Path) -> list[str]:
    """`path:line` for each `# fmt: skip` whose line above is not a comment (its reason)."""
    found = []
    for folder in PRODUCT_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                if line.rstrip().endswith("# fmt: skip") and not (i and lines[i - 1].lstrip().startswith("#")):
                    found.append(f"{path.relative_to(root)}:{i + 1}")
    return found


def test_every_fmt_skip_gives_its_reason() -> None:
    bare = bare_fmt_skips(ROOT)
    assert bare == []


def test_a_bare_fmt_skip_is_found(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "m.py").write_text(
        "x = [1,  2]  # fmt: skip\n# aligned: a table\ny = [1,  2]  # fmt: skip\n"
    )
    assert bare_fmt_skips(tmp_path) == ["server/m.py:1"]
