"""Files in and out of page-aligned memory: O_DIRECT where the filesystem takes it, buffered I/O where not.

O_DIRECT keeps the page cache out of the way (a disk tier 10-100x DRAM would only churn it, and a measured
read bandwidth would measure DRAM). It needs the buffer, offset and length aligned to the device's logical
block: buffers come from anonymous `mmap` (page-aligned), offsets and lengths are multiples of `ALIGN`.
tmpfs and some overlay filesystems refuse O_DIRECT (EINVAL at open or at the first read/write): the file is
then reopened without it, once, and the directory remembers (`DirectIO.direct`).

`os.preadv`/`os.pwritev` release the GIL, so a thread pool keeps many requests in flight on two cores.
`throttle_bytes_per_s` (tests, benchmarks) makes every read take at least bytes / rate seconds: a slow disk.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from radixkv.disk.object_format import ALIGN
from radixkv.memory.block_pool import cdiv

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CHUNK = 8 << 20  # bytes per pwritev/preadv call: bounded by the kernel's 2 GiB and friendlier to the queue


def aligned_buffer(num_bytes: int) -> mmap.mmap:
    """Zeroed, page-aligned memory of `num_bytes` rounded up to ALIGN."""
    return mmap.mmap(-1, max(ALIGN, cdiv(num_bytes, ALIGN) * ALIGN))


class DirectIO:
    """Reads and writes whole aligned files under one directory; `direct` says whether O_DIRECT is in use.

    Each thread reuses one aligned buffer (`buffer`), grown as needed: a fresh mapping per request would cost a
    page fault per 4 KiB, as much CPU as the copy itself.
    """

    def __init__(self, use_direct: bool = True, throttle_bytes_per_s: float | None = None) -> None:
        self.direct = use_direct and bool(_O_DIRECT)
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self._local = threading.local()

    def buffer(self, num_bytes: int) -> mmap.mmap:
        """This thread's aligned buffer, at least `num_bytes` (rounded up to ALIGN); valid until its next call."""
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < num_bytes:
            buf = self._local.buf = aligned_buffer(max(num_bytes, 1 << 20))
        return buf

    def _open(self, path: Path, flags: int) -> tuple[int, bool]:
        """A descriptor of `path`, and whether it is O_DIRECT."""
        if self.direct:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        return os.open(path, flags, 0o644), False

    def write_file(self, path: Path, parts: list[memoryview], durable: bool) -> None:
        """Write `parts` one after the other as a new file `path` (each a whole number of ALIGN pages, on page-aligned
        memory); fsync if `durable`."""
        assert all(len(part) % ALIGN == 0 for part in parts), "write_file writes whole aligned pages"
        fd, direct = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                _pwrite_parts(fd, parts)
            except OSError as e:
                if e.errno != errno.EINVAL or not direct:
                    raise
                self.direct = False  # the filesystem took O_DIRECT at open and refused it at write
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
                _pwrite_parts(fd, parts)
            if durable:
                os.fdatasync(fd)  # the data and the size; the name is made durable by the directory's fsync
        finally:
            os.close(fd)

    def sync(self, path: Path) -> None:
        """Make a written file's data and size durable (its name is made durable by the directory's fsync)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read_into(self, path: Path, offset: int, dest: npt.NDArray[np.uint8]) -> int:
        """Read bytes [offset, offset + dest.size) of `path` into `dest` (C-contiguous uint8); returns how many were
        read (fewer at the end of a short file)."""
        began = time.perf_counter()
        fd, direct = self._open(path, os.O_RDONLY)
        try:
            try:
                got = self._read(fd, direct, offset, dest)
            except OSError as e:
                if e.errno != errno.EINVAL or not direct:
                    raise
                self.direct = False  # the filesystem took O_DIRECT at open and refused it at read
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
                got = self._read(fd, False, offset, dest)
        finally:
            os.close(fd)
        if self.throttle_bytes_per_s:
            time.sleep(max(0.0, got / self.throttle_bytes_per_s - (time.perf_counter() - began)))
        return got

    def _read(self, fd: int, direct: bool, offset: int, dest: npt.NDArray[np.uint8]) -> int:
        """Straight into `dest` when O_DIRECT allows it (offset, length and address aligned, as `aligned_rows` and
        whole-page blocks make them) or is off; else through this thread's buffer, widened to ALIGN, and copied."""
        view = dest.data.cast("B")  # ndarray.data: the array's memoryview (its buffer, typed)
        num_bytes = len(view)
        if not direct or (offset % ALIGN == 0 and num_bytes % ALIGN == 0 and dest.ctypes.data % ALIGN == 0):
            return _pread_all(fd, view, num_bytes, offset)
        start = offset - offset % ALIGN
        length = cdiv(offset + num_bytes - start, ALIGN) * ALIGN
        buffer = memoryview(self.buffer(length))
        skip = offset - start
        got = max(0, min(num_bytes, _pread_all(fd, buffer, length, start) - skip))
        view[:got] = buffer[skip : skip + got]
        return got


def aligned_rows(num_rows: int, row_bytes: int) -> npt.NDArray[np.uint8]:
    """[num_rows, row_bytes] uint8 on page-aligned memory: O_DIRECT reads whole-page rows straight into it."""
    return np.frombuffer(aligned_buffer(num_rows * row_bytes), np.uint8, num_rows * row_bytes).reshape(
        num_rows, row_bytes
    )


def _pwrite_parts(fd: int, parts: list[memoryview]) -> None:
    pos = 0
    for part in parts:
        done = 0
        while done < len(part):
            n = os.pwritev(fd, [part[done : done + _CHUNK]], pos + done)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n
        pos += done


def _pread_all(fd: int, view: memoryview, num_bytes: int, offset: int) -> int:
    pos = 0
    while pos < num_bytes:
        n = os.preadv(fd, [view[pos : min(num_bytes, pos + _CHUNK)]], offset + pos)
        if n <= 0:
            break  # end of file
        pos += n
    return pos


def fsync_dir(path: Path) -> None:
    """Make the renames into `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
