"""A stand-in `radixkv` package: `radixkv.kernels` straight from a source checkout, with nothing installed.

setuptools maps the checkout's folders into one namespace (`kernels/` is `radixkv.kernels`, `server/` is
`radixkv.server`, ...). With this folder first on PYTHONPATH, `import radixkv.kernels` finds `kernels/`
the same way, and the kernels' own imports (`radixkv.kernels.*`) resolve to the same modules, one copy
each. The core (`radixkv/*.py`, whose `__init__` needs sortedcontainers, cbor2, msgpack, ...) is not on
this package's path: the kernels never import it, and anything that tries fails at once. That is how
`benchmarks/gpu_check.sh` runs on a bare GPU image (torch, triton and numpy) and how
`tests/kernels/test_import_closure.py` proves the kernels need nothing more.

    PYTHONPATH=benchmarks/from_checkout python -c "import radixkv.kernels"
"""

import pathlib

__path__ = [str(pathlib.Path(__file__).resolve().parents[3])]  # the checkout: radixkv.<folder> is <folder>/
