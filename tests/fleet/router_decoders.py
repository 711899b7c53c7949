"""The decoding rules of the routers that consume vLLM's KV events, reproduced to run against radixkv's stream.

llm-d-router v0.10.0 (tag commit 71f4f0999f95b96c49a9d0c4afbd18dfdb943c26), read at the tag:
- `pkg/kvevents/zmq_subscriber.go`: `parseEventFrame` (exactly 3 frames, seq the first 8 bytes of frame 2,
  big-endian); `requestReplay` (a DEALER sends `["", start u64 BE]`; each reply has its leading empty frame
  stripped; `[_, _, ""]` (3 frames, empty payload) ends it; any other reply must parse as an event frame
  whose seq is the next expected, else "malformed replay frame" / "incomplete replay" and the pod's index
  is wiped).
- `pkg/kvevents/engineadapter/vllm_adapter.go`: the batch is vmihailenco/msgpack v5 decoding a
  `msgpack:",array"` struct of 3 fields (an array of any other length is "number of fields in
  array-encoded struct has changed"); each event an array or a map tagged "type", map fields taken in
  vLLM's order; `common.go`: a hash must decode as uint64, int64 or bytes (msgpack uint64/int64 width, so a
  value of at least 2^32 or a byte string), `extra_keys` entries nil or arrays.
- `pkg/kvcache/kvblock/token_processor.go`, `extra_keys.go` and
  `pkg/epp/framework/plugins/requestcontrol/dataproducer/preciseprefixcache/blockkeys.go`: llm-d recomputes
  its own keys from `token_ids`, FNV-64a over canonical CBOR `[parent, tokens, extra]`, the chain rooted at
  `hash(fnv64a(hashSeed), nil, model)`; a string in a block's `extra_keys` joins that block's `extra`
  (`ParseRawExtraKeys`), and a request's `cache_salt` is appended to its first block's (`foldCacheSalt`).

Dynamo (ai-dynamo/dynamo `lib/kv-router/src/zmq_wire.rs` and `lib/llm/src/kv_router/publisher/zmq_listener.rs`,
commit 0cda21dc69fd4cfa51a4d62cc76028e0f1b71f06): exactly 3 frames with an 8-byte seq; the batch an rmp-serde
tuple `(f64, Vec<RawKvEvent>, Option<i32>)` (exactly 3 elements); a map event needs "type", and for
BlockStored `block_hashes` (u64/i64), `token_ids` (u32s), `block_size`; `extra_keys` a list of optional lists
of strings, (string, int) pairs, bytes, numbers or bools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cbor2
import msgpack

U32 = (1 << 32) - 1
FNV64_OFFSET, FNV64_PRIME = 0xCBF29CE484222325, 0x100000001B3


class Refused(ValueError):
    """A frame or payload the router drops (or, in a replay, a reply that makes it wipe the pod's index)."""


# -- llm-d-router v0.10.0 ----------------------------------------------------------------------------------------


def llm_d_event_frame(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    if len(frames) != 3 or len(frames[1]) < 8:
        raise Refused(f"malformed event frame: {len(frames)} frames")
    return frames[0].decode(), int.from_bytes(frames[1][:8], "big"), frames[2]


def llm_d_replay_reply(frames: Sequence[bytes], expected_seq: int) -> tuple[str, int, bytes] | None:
    """One DEALER-side reply: None for the end of the replay, else (topic, seq, payload)."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3 and frames[2] == b"":
        return None
    try:
        topic, seq, payload = llm_d_event_frame(frames)
    except Refused:
        raise Refused(f"malformed replay frame with {len(frames)} frames") from None
    if seq != expected_seq:
        raise Refused(f"incomplete replay: expected sequence {expected_seq}, got {seq}")
    return topic, seq, payload


def _llm_d_hash(value: Any) -> int:
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    if isinstance(value, int) and not isinstance(value, bool) and value > U32:  # msgpack uint64 / int64 width
        return value & ((1 << 64) - 1)
    raise Refused(f"unsupported hash type for {value!r}")


def llm_d_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one batch as llm-d's vLLM adapter converts them (BlockStored / BlockRemoved / cleared)."""
    batch = msgpack.unpackb(payload)
    if not isinstance(batch, list) or len(batch) != 3:
        raise Refused("msgpack: number of fields in array-encoded struct has changed")
    if not isinstance(batch[0], float) or not isinstance(batch[1], list):
        raise Refused("failed to decode vLLM event batch")
    events = []
    for raw in batch[1]:
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
            raise Refused("event is not a map tagged by a string type")
        kind = raw["type"]
        if kind == "BlockStored":
            extra = raw.get("extra_keys")
            if extra is not None and any(k is not None and not isinstance(k, list) for k in extra):
                raise Refused("extra_keys entry is neither nil nor an array")
            tokens = raw["token_ids"]
            if not all(isinstance(t, int) and 0 <= t <= U32 for t in tokens):
                raise Refused("token_ids are not uint32")
            parent = raw["parent_block_hash"]
            events.append(
                {
                    "type": kind,
                    "block_hashes": [_llm_d_hash(h) for h in raw["block_hashes"]],
                    "parent_block_hash": 0 if parent is None else _llm_d_hash(parent),
                    "token_ids": tokens,
                    "block_size": raw["block_size"],
                    "medium": raw.get("medium"),
                    "lora_name": raw.get("lora_name"),
                    "extra_keys": extra,
                }
            )
        elif kind == "BlockRemoved":
            events.append({"type": kind, "block_hashes": [_llm_d_hash(h) for h in raw["block_hashes"]]})
        elif kind == "AllBlocksCleared":
            events.append({"type": kind})
        else:
            raise Refused(f"unknown vLLM event tag: {kind}")
    return events


def parse_raw_extra_keys(raw: list[list[Any] | None] | None) -> list[list[str] | None] | None:
    """kvblock.ParseRawExtraKeys: per block, its string entries (and the first string of [hash, offset] pairs)."""
    if raw is None:
        return None
    out: list[list[str] | None] = []
    for keys in raw:
        hashes = []
        for entry in keys or ():
            if isinstance(entry, str):
                hashes.append(entry)
            elif isinstance(entry, list) and entry and isinstance(entry[0], str):
                hashes.append(entry[0])
        out.append(hashes or None)
    return out


def fold_cache_salt(extra: list[list[str] | None] | None, salt: str, num_blocks: int) -> list[list[str] | None] | None:
    """preciseprefixcache.foldCacheSalt: a request's salt appended to its first block's extra features."""
    if not salt or not num_blocks:
        return extra
    extra = list(extra) if extra is not None else [None] * num_blocks
    extra[0] = [*(extra[0] or []), salt]
    return extra


def _fnv64a(data: bytes) -> int:
    h = FNV64_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & ((1 << 64) - 1)
    return h


def _llm_d_hash_payload(parent: int, tokens: Sequence[int] | None, extra: Any) -> int:
    return _fnv64a(cbor2.dumps([parent, None if tokens is None else list(tokens), extra], canonical=True))


def llm_d_keys(
    tokens: Sequence[int], model: str, block_size: int, extra: list[list[str] | None] | None = None,
    parent: int | None = None, hash_seed: str = "",
) -> list[int]:  # fmt: skip
    """chunkedTokenDatabase.TokensToKVBlockKeys: the keys llm-d indexes a prompt (or a stored event) by."""
    chunks = [tokens[i : i + block_size] for i in range(0, len(tokens) - block_size + 1, block_size)]
    if parent is None:
        parent = _llm_d_hash_payload(_fnv64a(hash_seed.encode()), None, model)
    keys = []
    for i, chunk in enumerate(chunks):
        features = None if extra is None or extra[i] is None else [{"Hash": h} for h in extra[i]]
        parent = _llm_d_hash_payload(parent, chunk, features)
        keys.append(parent)
    return keys


# -- Dynamo ------------------------------------------------------------------------------------------------------


def _dynamo_extra_item(item: Any) -> bool:
    if isinstance(item, str | bytes | int | float | bool):
        return True
    return isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int)


def dynamo_batch(frames: Sequence[bytes]) -> list[dict[str, Any]]:
    """zmq_listener's decode_zmq_kv_batch on one message: its events, or Refused (logged and skipped)."""
    if len(frames) != 3:
        raise Refused(f"expected three ZMQ frames, received {len(frames)}")
    if len(frames[1]) != 8:
        raise Refused(f"ZMQ sequence must contain eight bytes, received {len(frames[1])}")
    batch = msgpack.unpackb(frames[2])
    if not isinstance(batch, list) or len(batch) != 3:
        raise Refused("failed to decode KV event batch: a tuple of 3")
    ts, events, rank = batch
    if not isinstance(ts, int | float) or not isinstance(events, list) or not (rank is None or isinstance(rank, int)):
        raise Refused("failed to decode KV event batch")
    for event in events:
        if not isinstance(event, dict) or event.get("type") not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            raise Refused("unknown variant or missing field type")
        if event["type"] == "BlockStored":
            for field in ("block_hashes", "token_ids", "block_size"):
                if field not in event:
                    raise Refused(f"missing field {field}")
            if not all(isinstance(t, int) and 0 <= t <= U32 for t in event["token_ids"]):
                raise Refused("token_ids are not u32")
            for keys in event.get("extra_keys") or ():
                if keys is not None and not (isinstance(keys, list) and all(_dynamo_extra_item(k) for k in keys)):
                    raise Refused("extra_keys entry of an unknown shape")
        if event["type"] != "AllBlocksCleared":
            if not all(isinstance(h, int) and 0 <= h < (1 << 64) for h in event["block_hashes"]):
                raise Refused("block hash is neither u64 nor i64")
    return events
