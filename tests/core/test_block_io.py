"""`DirectIO.read_into` returns exactly the file's bytes for any range into any destination: straight into aligned
rows with O_DIRECT, through the thread's aligned buffer otherwise (an unaligned offset, length or address), and
short at the end of the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.disk.block_io import DirectIO, aligned_buffer, aligned_rows
from radixkv.disk.object_format import ALIGN

SIZE = 5 * ALIGN
CONTENT = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)


def written(directory: Path, io: DirectIO) -> Path:
    path = directory / "f.bin"
    if not path.exists():
        buffer = aligned_buffer(SIZE)
        buffer[:] = CONTENT.tobytes()
        io.write_file(path, [memoryview(buffer)], durable=False)
    return path


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, SIZE), length=st.integers(0, 3 * ALIGN), shift=st.integers(0, 64))
def test_any_range_into_any_destination_reads_the_files_bytes(
    tmp_path_factory: pytest.TempPathFactory, offset: int, length: int, shift: int
) -> None:
    directory = tmp_path_factory.getbasetemp() / "block_io"  # on the disk under /tmp: O_DIRECT where it is taken
    directory.mkdir(exist_ok=True)
    io = DirectIO()
    path = written(directory, io)
    backing = np.zeros(length + shift, np.uint8)
    dest = backing[shift:]  # any address, aligned or not
    got = io.read_into(path, offset, dest)
    expected = CONTENT[offset : offset + length]
    assert got == len(expected) and np.array_equal(dest[:got], expected)


def test_aligned_rows_take_whole_pages_straight(tmp_path: Path) -> None:
    io = DirectIO()
    path = written(tmp_path, io)
    rows = aligned_rows(2, 2 * ALIGN)
    assert rows.ctypes.data % ALIGN == 0
    assert io.read_into(path, ALIGN, rows) == 4 * ALIGN
    assert np.array_equal(rows.reshape(-1), CONTENT[ALIGN : 5 * ALIGN])
    assert io.read_into(path, 3 * ALIGN, rows) == 2 * ALIGN, "short at the end of the file"
