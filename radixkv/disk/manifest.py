"""A disk tier directory's manifest: written once, it says which pool shape the directory's objects hold.

`DIR/radixkv-disk.cbor` holds the format version and the pool's `DiskShape` (layout and hash contract). A server
whose pool differs refuses the directory at start, naming the fields, instead of refusing every object in it one
by one (and removing another model's blocks). Objects still carry the shape each: a file moved in from another
directory is refused by its own header.
"""

from __future__ import annotations

import os
from pathlib import Path

import cbor2

from radixkv.disk.block_io import fsync_dir
from radixkv.disk.object_format import FORMAT_VERSION, DiskShape

MANIFEST = "radixkv-disk.cbor"


class DiskTierError(RuntimeError):
    """The directory cannot serve as this pool's disk tier (another shape, not writable, full): said at start."""


def check_manifest(directory: Path, shape: DiskShape) -> None:
    """Write the manifest of a new directory (temp, fsync, rename, fsync the directory); refuse another pool's.

    Raises:
        DiskTierError: the directory was written for another format version or pool shape.
    """
    path = directory / MANIFEST
    if path.exists():
        stored = cbor2.loads(path.read_bytes())
        if stored.get("format_version") != FORMAT_VERSION:
            raise DiskTierError(f"disk_dir {directory}: format version {stored.get('format_version')}")
        differences = shape.differences(stored.get("shape", {}))
        if differences:
            raise DiskTierError(
                f"disk_dir {directory} holds another pool's blocks; fields that differ "
                f"(this pool, the directory's): {differences}"
            )
        return
    part = directory / "tmp" / MANIFEST
    part.write_bytes(cbor2.dumps({"format_version": FORMAT_VERSION, "shape": shape.as_dict()}, canonical=True))
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, path)
    fsync_dir(directory)
