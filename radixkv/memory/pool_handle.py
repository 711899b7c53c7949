"""The plain-field handle another process maps a pool by: plain values, so it travels without pickle.

Kept apart from `radixkv.memory.storage` because building and checking a handle needs no torch: the client and
the keeper read handles before (or without) mapping any memory. The wire form is the edges' business: the
server writes it (`radixkv.server.wire.servicer`), the client reads it
(`radixkv.client.worker.pool_view.handle_from_proto`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixkv.memory.layout import PoolLayout

LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype")
_FIELD_TYPES: dict[str, type] = {"str": str, "int": int, "bytes": bytes, "bool": bool}  # PoolHandle's annotations


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolHandle:
    """What another process needs to map a pool: plain str/int/bool/bytes fields, so it travels without pickle.

    `kind` is "shm" (`name` is the shared-memory segment) or "cuda_ipc" (the remaining fields are the storage's
    part of what torch's public `torch.multiprocessing.reductions.reduce_tensor` returns, mapped in
    `radixkv.memory.cuda_ipc`; `device_index` must name the same GPU in the opener).
    """

    kind: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str
    name: str = ""
    device_index: int = -1
    ipc_handle: bytes = b""
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False

    @property
    def layout(self) -> PoolLayout:
        return PoolLayout(**{f: getattr(self, f) for f in LAYOUT_FIELDS})

    def to_dict(self) -> dict[str, str | int | bool]:
        """JSON-able values: bytes become hex strings."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: v.hex() if isinstance(v, bytes) else v for name, v in values.items()}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> PoolHandle:
        """Inverse of `to_dict`. Raises ValueError on a missing, unknown or mistyped field."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"PoolHandle: unknown fields {unknown}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name not in fields:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"PoolHandle: missing field {name!r}")
                continue
            values[name] = _from_plain(name, fields[name], _FIELD_TYPES[str(f.type)])
        handle = cls(**values)
        if handle.kind not in ("shm", "cuda_ipc"):
            raise ValueError(f"PoolHandle: kind must be 'shm' or 'cuda_ipc', got {handle.kind!r}")
        handle.layout  # noqa: B018 -- validates the layout fields
        return handle


def _from_plain(name: str, value: object, kind: type) -> object:
    if kind is bytes:
        if not isinstance(value, str):
            raise ValueError(f"PoolHandle: {name} must be a hex string, got {type(value).__name__}")
        return bytes.fromhex(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"PoolHandle: {name} must be {kind.__name__}, got {type(value).__name__}")
    return value
