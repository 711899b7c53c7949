"""Byte sizes as people write them: `200GiB`, `1.5TB`, `512MiB`, `1000000`."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """Bytes in `text`: a number with an optional unit (k/M/G/T in powers of ten, KiB/MiB/GiB/TiB in powers of
    two). ValueError naming the text otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a size (a number with an optional unit: 200GiB, 1.5TB, 512MiB)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be > 0")
    return value
