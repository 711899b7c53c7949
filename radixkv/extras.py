"""The pip command that adds an extra to this radixkv, from where it was installed: radixkv is not on a package
index, so `pip install 'radixkv[server]'` finds nothing; the checkout or wheel it came from does."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path


def install_hint(extras: str) -> str:
    """`pip install [-e] 'SOURCE[extras]'` for the checkout or wheel this radixkv was installed from."""
    try:
        direct_url = metadata.distribution("radixkv").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        direct_url = None
    if direct_url:
        info = json.loads(direct_url)
        url = str(info.get("url", ""))
        if url.startswith("file://"):
            editable = "-e " if info.get("dir_info", {}).get("editable") else ""
            return f"pip install {editable}'{url.removeprefix('file://')}[{extras}]'"
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():  # a checkout on sys.path
        return f"pip install -e '{root}[{extras}]'"
    return f"pip install 'CHECKOUT[{extras}]' or 'dist/radixkv-VERSION-py3-none-any.whl[{extras}]' (radixkv's checkout)"
