"""Suite-wide set-up: one torch thread a process, Triton runs in its interpreter where there is no GPU, and `gpu`
tests skip."""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# One intra-op thread for torch in this process and in every process a test starts (servers, keepers, workers,
# benchmarks inherit the environment): `make test` runs three workers and their servers on two cores, where
# more threads only contend and spin (~11% of the suite's CPU time). Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
