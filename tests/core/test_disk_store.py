"""The disk tier's store on real files: round trips, the index rebuilt from the directory alone, and every kind of
damage (torn, flipped, truncated, foreign) refused, counted, removed and never served; the byte cap and shares."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from radixkv.disk.block_io import DirectIO
from radixkv.disk.object_format import ALIGN, OBJECT_SUFFIX
from radixkv.disk.shape import disk_shape
from radixkv.disk.store import DiskStore, DiskTierError
from radixkv.memory.layout import PoolLayout
from radixkv.tree.block_hash import chain_hashes

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=8, dtype="float16")
SHAPE = disk_shape(LAYOUT)  # 8 KiB blocks


def blocks_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SHAPE.bytes_per_block), dtype=np.uint8)


def hashes_of(n: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * LAYOUT.block_size).tolist()
    return chain_hashes(tokens, LAYOUT.block_size)


def store(path: Path, capacity: int = 1 << 30, **kwargs: object) -> DiskStore:
    s = DiskStore(path, SHAPE, capacity, target_object_bytes=64 << 10, **kwargs)  # type: ignore[arg-type]
    s.open()
    return s


def object_files(path: Path) -> list[Path]:
    return sorted(path.glob(f"objects/*/*{OBJECT_SUFFIX}"))


def test_blocks_round_trip_and_survive_a_rebuild_from_the_directory_alone(tmp_path: Path) -> None:
    hashes, blocks = hashes_of(20), blocks_of(20)
    s = store(tmp_path)
    assert s.put("", hashes, blocks) == 20
    assert s.num_objects == 3  # 8 blocks of 8 KiB per 64 KiB object
    assert s.put("", hashes, blocks) == 0  # already on disk: nothing written twice
    assert np.array_equal(s.read(hashes), blocks)
    s.check_invariants()
    s.close()
    again = store(tmp_path)
    assert len(again) == 20 and again.num_on_disk(hashes) == 20
    assert np.array_equal(again.read(hashes[:13]), blocks[:13])
    assert again.num_on_disk([*hashes[:5], b"\0" * 32, hashes[6]]) == 5
    again.check_invariants()


def test_a_flipped_bit_is_refused_counted_removed_and_the_run_ends_before_it(tmp_path: Path) -> None:
    hashes, blocks = hashes_of(16), blocks_of(16)
    s = store(tmp_path)
    s.put("", hashes, blocks)
    second = next(o for o in s._objects.values() if o.hashes[0] == hashes[8])
    with open(second.path, "r+b") as f:  # one bit of the second object's third block
        f.seek(second.data_offset + 2 * SHAPE.bytes_per_block + 100)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    got = s.read(hashes)
    assert np.array_equal(got, blocks[:8])  # the first object only; nothing of the bad one is served
    assert s.refused == {"corrupt": 1} and not second.path.exists()
    assert s.num_on_disk(hashes) == 8
    s.check_invariants()


@pytest.mark.parametrize("damage", ["truncated", "header", "foreign_magic", "stray_file"])
def test_a_damaged_or_foreign_file_is_refused_at_rebuild(tmp_path: Path, damage: str) -> None:
    hashes, blocks = hashes_of(16), blocks_of(16)
    s = store(tmp_path)
    s.put("", hashes, blocks)
    s.close()
    victim = object_files(tmp_path)[0]
    if damage == "truncated":
        os.truncate(victim, victim.stat().st_size - ALIGN)
    elif damage == "header":
        with open(victim, "r+b") as f:
            f.seek(60)
            f.write(b"\xff\xff")
    elif damage == "foreign_magic":
        victim.write_bytes(b"GGUF" + b"\0" * (2 * ALIGN))
    else:
        victim = victim.parent / "notes.txt"
        victim.write_text("hello")
    again = store(tmp_path)
    why = {"truncated": "truncated", "header": "corrupt", "foreign_magic": "foreign", "stray_file": "foreign"}[damage]
    assert again.refused == {why: 1} and not victim.exists()
    assert len(again) == (16 if damage == "stray_file" else 8)
    served = again.read(hashes)
    assert len(served) in (0, 8, 16) and np.array_equal(served, blocks[: len(served)])


def test_a_directory_of_another_shape_is_refused_at_start_naming_the_fields(tmp_path: Path) -> None:
    store(tmp_path).put("", hashes_of(4), blocks_of(4))
    other = disk_shape(
        PoolLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=8, dtype="bfloat16")
    )
    with pytest.raises(DiskTierError, match="dtype"):
        DiskStore(tmp_path, other, 1 << 30).open()


def test_an_object_of_another_shape_in_this_directory_is_never_read_as_this_one(tmp_path: Path) -> None:
    other_dir = tmp_path / "other"
    other = DiskStore(
        other_dir,
        disk_shape(PoolLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=8, dtype="float16")),
        1 << 30,
    )
    other.open()
    hashes = hashes_of(4)
    other.put("", hashes, np.zeros((4, other.shape.bytes_per_block), np.uint8))
    store(tmp_path / "mine").close()
    planted = object_files(other_dir)[0]
    (tmp_path / "mine" / "objects" / planted.parent.name).mkdir(exist_ok=True)
    os.rename(planted, tmp_path / "mine" / "objects" / planted.parent.name / planted.name)
    mine = store(tmp_path / "mine")
    assert mine.refused == {"foreign": 1} and mine.num_on_disk(hashes) == 0


def test_sigkill_during_stores_leaves_only_whole_objects(tmp_path: Path) -> None:
    """A child stores objects in a loop and is killed mid-write: every object the next start indexes reads back
    whole, and the interrupted writes are counted as torn and removed."""
    ready = tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_disk_store import store, hashes_of, blocks_of
            from pathlib import Path
            s = store(Path({str(tmp_path / "d")!r}))
            i = 0
            while True:
                s.put("", hashes_of(64, seed=i), blocks_of(64, seed=i))
                i += 1
                if i == 2:
                    Path({str(ready)!r}).touch()
            """)],
    )  # fmt: skip
    try:
        while not ready.exists():
            assert child.poll() is None, "the writer died on its own"
            os.sched_yield()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    s = store(tmp_path / "d")
    assert len(s) >= 128
    for seed in range(1000):
        hashes = hashes_of(64, seed=seed)
        n = s.num_on_disk(hashes)
        got = s.read(hashes[:n])
        assert np.array_equal(got, blocks_of(64, seed=seed)[: len(got)])
        if not n and seed > 2:
            break
    assert set(s.refused) <= {"torn"} and not list((tmp_path / "d" / "tmp").iterdir())
    s.check_invariants()


def test_the_byte_cap_holds_by_removing_the_least_recently_used_objects(tmp_path: Path) -> None:
    cap = 10 * (64 << 10) + 10 * ALIGN  # ten objects of 8 blocks, headers included
    s = store(tmp_path, capacity=cap)
    first = hashes_of(8, seed=100)
    s.put("", first, blocks_of(8, seed=100))
    for seed in range(30):
        s.put("", hashes_of(8, seed=seed), blocks_of(8, seed=seed))
        s.read(first)  # used: stays
        assert s.num_bytes <= cap
        assert sum(p.stat().st_size for p in object_files(tmp_path)) <= cap
        s.check_invariants()
    assert s.num_on_disk(first) == 8 and s.num_on_disk(hashes_of(8, seed=0)) == 0
    assert s.num_evicted_blocks > 0


def test_a_tenant_over_its_share_loses_its_own_objects_first(tmp_path: Path) -> None:
    obj = (64 << 10) + ALIGN
    s = store(tmp_path, capacity=100 * obj, tenant_of=lambda ns: ns.split("/")[0],
              share_bytes=lambda t: 3 * obj if t == "a" else None)  # fmt: skip
    s.put("b/x", hashes_of(8, seed=50), blocks_of(8))
    for seed in range(6):
        s.put("a/x", hashes_of(8, seed=seed), blocks_of(8))
    assert s.bytes_in["a"] <= 3 * obj and s.num_on_disk(hashes_of(8, seed=50)) == 8
    assert s.num_on_disk(hashes_of(8, seed=5)) == 8 and s.num_on_disk(hashes_of(8, seed=0)) == 0


class FailingIO(DirectIO):
    def __init__(self, code: int) -> None:
        super().__init__()
        self.code, self.failing = code, False

    def write_file(self, path: Path, parts: list[memoryview], durable: bool) -> None:
        if self.failing:
            raise OSError(self.code, os.strerror(self.code))
        super().write_file(path, parts, durable)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_at_run_time_is_counted_not_raised(tmp_path: Path, code: int) -> None:
    io = FailingIO(code)
    s = store(tmp_path, io=io)
    s.put("", hashes_of(8, seed=1), blocks_of(8))
    io.failing = True
    assert s.put("", hashes_of(8, seed=2), blocks_of(8)) == 0
    assert s.num_write_errors == 1 and s.num_on_disk(hashes_of(8, seed=1)) == 8
    assert not list((tmp_path / "tmp").iterdir())
    s.check_invariants()
    io.failing = False
    assert s.put("", hashes_of(8, seed=2), blocks_of(8)) == 8  # the next write tries again


def test_an_unwritable_directory_is_a_clear_error_at_start(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskTierError, match="cannot write"):
        DiskStore(tmp_path / "file" / "d", SHAPE, 1 << 30).open()
    io = FailingIO(errno.EROFS)
    io.failing = True
    with pytest.raises(DiskTierError, match="cannot write"):
        DiskStore(tmp_path / "ro", SHAPE, 1 << 30, io=io).open()
