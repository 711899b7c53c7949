"""Copy instructions for the worker: `[n, 2]` arrays of `(src_block, dst_block)` (offloads, loads, copy-on-write).

The core moves no data; every call that moves K/V hands the worker such pairs, applied in order. They are shared
by the host tier, swapping and the step results, so they live below all of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

Pairs = npt.NDArray[np.int64]  # [n, 2] (src_block, dst_block)
NO_PAIRS: Pairs = np.empty((0, 2), dtype=np.int64)
NO_PAIRS.flags.writeable = False


def pairs_of(src: npt.NDArray[np.int32], dst: npt.NDArray[np.int32]) -> Pairs:
    """Pair `src[i]` with `dst[i]`."""
    return np.stack([src, dst], axis=1).astype(np.int64)


def concat_pairs(runs: Iterable[Pairs]) -> Pairs:
    """Runs of pairs, in order, as one array (results of several calls that the worker applies as one)."""
    runs = [run for run in runs if len(run)]
    return np.concatenate(runs) if runs else NO_PAIRS
