"""vLLM 0.33/0.34's KV-events structs and block hasher, reproduced to decode and check radixkv's stream.

Sources, read in the released wheels (`pip download vllm==0.33.0 / 0.34.0 --no-deps`); both files are
identical between the two releases where used here:

- `vllm/distributed/kv_events.py`: `EventBatch` (msgspec Struct, `array_like`, `omit_defaults`, `gc=False`),
  `KVCacheEvent` (`omit_defaults`, `gc=False`, `tag=True`: a map tagged "type"), `BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`; `ZmqEventPublisher` (PUB `[topic, seq, payload]`,
  ROUTER replay `[identity, "", topic, seq, payload]`, end `[identity, "", "", END_SEQ, ""]`).
- `vllm/v1/core/kv_cache_utils.py`: `ExternalBlockHash = bytes | int`, `maybe_convert_block_hash` (low 64 bits
  when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, default 1 in `vllm/envs.py`), `init_none_hash` (the fixed seed
  "vllm-none-hash" for a cryptographic hash when PYTHONHASHSEED is unset), `hash_block_tokens`,
  `generate_block_hash_extra_keys` (`("cache_salt", salt)` on the first block only, after LoRA and MM keys),
  `to_event_extra_keys` (untagged), `get_request_block_hasher` (full blocks, chained).
- `vllm/utils/hashing.py`: `sha256_cbor` = sha256 of `cbor2.dumps(obj, canonical=True)`.

`test_vllm_wire.py` checks these definitions against vLLM itself where vLLM is installed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2
import msgspec

ExternalBlockHash = bytes | int
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """The tagged base: each event a map whose "type" is its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)  # what vLLM's own subscribers decode with
ENCODER = msgspec.msgpack.Encoder()  # what vLLM's publisher thread encodes with


# -- the hasher (prefix_caching_hash_algo="sha256_cbor", no LoRA, no multimodal, no lookahead) ------------------


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


NONE_HASH = sha256_cbor("vllm-none-hash")  # init_none_hash with PYTHONHASHSEED unset


def extra_keys(start_token_idx: int, cache_salt: str | None) -> tuple[Any, ...] | None:
    """generate_block_hash_extra_keys for a text-only request without LoRA."""
    keys = [("cache_salt", cache_salt)] if start_token_idx == 0 and cache_salt else []
    return tuple(keys) if keys else None


def hash_block_tokens(parent: bytes | None, tokens: Sequence[int], keys: tuple[Any, ...] | None) -> bytes:
    return sha256_cbor((parent or NONE_HASH, tuple(tokens), keys))


def request_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """get_request_block_hasher's chain over a prompt's full blocks."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys(start, cache_salt))
        hashes.append(parent)
    return hashes


def to_event_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's hashed extra keys as its BlockStored event carries them: untagged."""
    return None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)


def external(block_hash: bytes) -> int:
    """maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (the default)."""
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)
