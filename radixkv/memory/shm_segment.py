"""Named POSIX shared memory for CPU pools: creating a segment, attaching without a resource tracker, and byte views
that keep the mapping alive as long as any tensor views it.

The lifetime rules here are subtle (who unlinks, when a mapping may close); `radixkv.memory.storage` builds on them.
"""

from __future__ import annotations

import mmap
import os
import secrets
import sys
import weakref
from multiprocessing import shared_memory

import numpy as np
import torch

from radixkv.memory.layout import PoolLayout

SHM_DIR = "/dev/shm"


def create_segment(layout: PoolLayout, name: str | None) -> shared_memory.SharedMemory:
    """A new zero-filled segment for `layout` (None names it `radixkv-<pid>-<random>`).

    Raises:
        ValueError: more bytes than /dev/shm has free.
    """
    if os.path.isdir(SHM_DIR):
        free = shm_free_bytes()
        if layout.total_bytes > free:
            raise ValueError(f"layout: {layout.total_bytes} bytes do not fit the {free} bytes free in {SHM_DIR}")
    name = name or f"radixkv-{os.getpid()}-{secrets.token_hex(4)}"
    # The OS zero-fills new shared memory; the creator stays registered with the resource tracker,
    # which unlinks the segment if the creator dies without unlinking it.
    return shared_memory.SharedMemory(name=name, create=True, size=max(1, layout.total_bytes))


def bytes_over(shm: shared_memory.SharedMemory | AttachedSegment, layout: PoolLayout) -> torch.Tensor:
    """The segment's first `layout.total_bytes` as a uint8 tensor that keeps the mapping open while it lives."""
    # Not torch.frombuffer: it holds no buffer export, so SharedMemory.close() would unmap the memory
    # under live tensors (a read then segfaults). numpy's array keeps a memoryview (its .base) that holds
    # the mapping's export; that memoryview dies with the last tensor viewing the pool, and only then,
    # once the export is released, does the finalizer close the segment.
    assert shm.buf is not None, "KVStorage: the segment is already closed"
    array = np.frombuffer(shm.buf, dtype=np.uint8, count=layout.total_bytes)
    weakref.finalize(array.base, shm.close).atexit = False
    return torch.from_numpy(array)  # uint8 [total_bytes]


class AttachedSegment:
    """An existing segment mapped from its file under /dev/shm: what `SharedMemory(name)` maps on Linux (where POSIX
    shared memory is that tmpfs, shm_overview(7)), without registering it with a resource tracker.

    Offers what `KVStorage` reads of a `SharedMemory`: `name`, `size`, `buf` and `close`.
    """

    def __init__(self, name: str):
        # O_NOFOLLOW: a name is a segment, never a link out of /dev/shm (as shm_open opens it).
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)  # the mapping holds the memory; the descriptor is not needed once mapped
        self.name = name
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap (as `SharedMemory.close`: a BufferError while a view still exports the memory). Idempotent."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        self._mmap.close()


def attach_untracked(name: str) -> shared_memory.SharedMemory | AttachedSegment:
    """Attach to an existing segment without registering it with a resource tracker.

    Raises:
        ValueError: `name` is not a segment name (empty, or a path).
        FileNotFoundError: no such segment.
    """
    # An attaching process must not register the segment with a resource tracker: a tracker of its own
    # would unlink the creator's segment when this process exits, and a tracker shared with the creator
    # (multiprocessing children) would lose the creator's registration on unregister.
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"handle: {name!r} is not a shared-memory segment name")
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    # Before 3.13 SharedMemory always registers, and no public call attaches without it: map the file itself
    # (AttachedSegment goes when requires-python reaches 3.13).
    return AttachedSegment(name)


def shm_free_bytes() -> int:
    """Free bytes in /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize
