"""Suite-wide set-up: no Hypothesis deadline, Triton runs in its interpreter where there is no GPU, and `gpu` tests
skip."""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# No per-example time limit (Hypothesis' default deadline is 200 ms): a test asserts behaviour, not speed, and a
# loaded machine slows an example down tenfold. On top of the profile in force (Hypothesis loads "ci" under CI).
# "radixkv", the default, runs a third of the examples a test names (tests/examples.py: make test's few minutes);
# `--hypothesis-profile=thorough` runs them all (CI does).
try:
    from hypothesis import settings
except ImportError:  # the vLLM environment of `make test-vllm` has no Hypothesis
    pass
else:
    settings.register_profile("thorough", parent=settings.default, deadline=None, max_examples=100)
    settings.register_profile("radixkv", parent=settings.default, deadline=None, max_examples=35)
    settings.load_profile("radixkv")

# Must be set before triton is first imported anywhere in the run.
if not os.environ.get("RADIXKV_NO_INTERPRET") and not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `make test` hands whole files to its pytest-xdist workers in collection order: the files marked `slow` go
    # first, so that no worker starts one of them while the others have run out of work. A stable sort: each
    # file's tests stay together and in their order.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
