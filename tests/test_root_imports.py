"""Python started in the checkout root finds the top-level folders (kernels/, server/, ...) before installed packages.
Hugging Face's `kernels` (transformers 5 imports it) shares a name with kernels/: imported under that name, the
folder yields to the installed package (kernels/__init__.py), so transformers' model code imports from the root
and `python -m pytest` runs there as `make test` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.server.process.spawn import patient

ROOT = Path(__file__).resolve().parents[1]


def in_root(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python ARGV` with the checkout root as its working directory (first on sys.path for -c and -m)."""
    command = [sys.executable, *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=patient(600))


def test_transformers_model_code_imports_from_the_checkout_root() -> None:
    pytest.importorskip("kernels", reason="Hugging Face's kernels is not installed")  # from here: the installed one
    code = (
        "import transformers.models.llama.modeling_llama, kernels, radixkv.kernels\n"
        "print(kernels.__file__); print(radixkv.kernels.__file__)"
    )
    done = in_root("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours = done.stdout.split()
    # Hugging Face's, not the checkout's folder (a virtual environment may itself lie inside the checkout, as CI's does)
    assert not Path(theirs).resolve().is_relative_to(ROOT / "kernels"), "the top-level `kernels` is Hugging Face's"
    assert ours == str(ROOT / "kernels" / "__init__.py")


def test_without_the_installed_package_it_is_empty_and_says_which_to_import() -> None:
    """As transformers probes for it: the import succeeds, there is no __version__, and a name says where to look."""
    code = (
        "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
        "import kernels\n"
        "print(getattr(kernels, '__version__', 'N/A'))\n"
        "try:\n    kernels.copy_blocks\n"
        "except AttributeError as e:\n    print(e)\n"
    )
    done = in_root("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("N/A\n") and "imported as radixkv.kernels" in done.stdout


def test_python_m_pytest_runs_from_the_root() -> None:
    """`python -m pytest` puts the root on sys.path (unlike `.venv/bin/pytest`): a demo test that loads a checkpoint
    with transformers passes there too."""
    test = "tests/demo/test_model.py::test_tiny_llama_is_seeded_hf_format_and_written_once"
    done = in_root("-m", "pytest", "-q", "-p", "no:cacheprovider", test)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 passed" in done.stdout
