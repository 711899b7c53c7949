"""The vLLM connector's tests need vLLM's CPU build and a converted model: `make test-vllm` sets both up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = os.environ.get("RADIXKV_VLLM_MODEL")
    if not path or not (Path(path) / "radixkv-converted").exists():
        pytest.skip("no converted model: run `make test-vllm` (it sets RADIXKV_VLLM_MODEL)")
    return Path(path)
