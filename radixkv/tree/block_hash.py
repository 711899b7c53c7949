"""Block identity across processes: vLLM's `sha256_cbor` content hash, chained from a fixed root.

A block's hash is `sha256(cbor2.dumps((parent_hash or NONE_HASH, tuple(block_tokens), extra_keys),
canonical=True))`. Block ids are recycled, so nothing outside one process can key on them; the hash
names the same content the same way in every radixkv instance and in vLLM, so the routers that
consume vLLM's KV events (llm-d, Dynamo, Ray Serve) route over radixkv unmodified. On the wire a
hash is its low 64 bits, as vLLM publishes by default.

A namespace other than the default is a request's `cache_salt` as vLLM 0.31-0.34 hash it
(`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`): tagged, `(("cache_salt", salt),)`
as the first block's `extra_keys` only, the chain carrying it to every later block, so two namespaces
never share a hash. Events carry it untagged, `(salt,)`, as vLLM's `to_event_extra_keys` publishes it.
The salt is the namespace with `%`, `@`, `/`, backslash and NUL percent-escaped (`cache_salt`): vLLM's
OpenAI server refuses a `cache_salt` holding the last four, and escaping keeps distinct namespaces
distinct, so `acme/chat` (tenant acme's `chat` with auth on) is the salt `acme%2Fchat`.

`BlockHashes` is the side table block_id -> hash a tree observer keeps: each hash is computed
once, when its block enters the tree; splits and tail trims move or drop block ids, never re-hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import cbor2
import numpy as np
import numpy.typing as npt

from radixkv.tree.radix_tree import DEFAULT_NAMESPACE, Node

NONE_HASH: bytes = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
WIRE_MASK = (1 << 64) - 1

ExtraKeys = tuple[Any, ...] | None


def block_hash(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None) -> bytes:
    """The 32-byte hash of one full block following `parent_hash` (None: the first block)."""
    payload = (NONE_HASH if parent_hash is None else parent_hash, tuple(token_ids), extra_keys)
    return hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()


def wire_hash(digest: bytes) -> int:
    """The low 64 bits as an unsigned int: what vLLM's events carry."""
    return int.from_bytes(digest, "big") & WIRE_MASK


CACHE_SALT_TAG = "cache_salt"  # vLLM's tag for the salt in the hashed extra keys
_SALT_ESCAPES = {c: f"%{ord(c):02X}" for c in "%@/\\\x00"}  # escaping "%" too keeps the mapping one-to-one


def cache_salt(namespace: str) -> str | None:
    """The `cache_salt` a vLLM request carries to hash as `namespace` does: None for the default namespace."""
    if namespace == DEFAULT_NAMESPACE:
        return None
    return "".join(_SALT_ESCAPES.get(c, c) for c in namespace)


def namespace_salt(namespace: str) -> ExtraKeys:
    """The first block's hashed extra keys for `namespace`: None for the default, else `(("cache_salt", salt),)`."""
    salt = cache_salt(namespace)
    return None if salt is None else ((CACHE_SALT_TAG, salt),)


def event_salt(namespace: str) -> ExtraKeys:
    """The first block's extra keys as a `BlockStored` event carries them: untagged, `(salt,)`, or None."""
    salt = cache_salt(namespace)
    return None if salt is None else (salt,)


def chain_hashes(
    token_ids: Sequence[int], block_size: int, namespace: str = DEFAULT_NAMESPACE, parent_hash: bytes | None = None
) -> list[bytes]:
    """Hashes of every full block of `token_ids` (a prefix from the root when `parent_hash` is None)."""
    hashes: list[bytes] = []
    salt = namespace_salt(namespace) if parent_hash is None else None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = block_hash(parent_hash, token_ids[start : start + block_size], salt)
        hashes.append(parent_hash)
        salt = None
    return hashes


class BlockHashes:
    """block_id -> 32-byte hash of every block the tree holds, kept by the tree's observer.

    Invariant: the keys are exactly the tree's block ids (`check_against`). A block id is unique
    while cached, so the table survives a node split (ids move to the new upper node) and a tail
    trim (evicted ids are reported and dropped) without recomputing anything.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, block_id: int) -> bytes:
        return self._hashes[block_id]

    def get(self, block_id: int) -> bytes | None:
        return self._hashes.get(block_id)

    def parent_hash(self, node: Node) -> bytes | None:
        """The hash of the block before `node`'s first; None when `node` hangs off its namespace's root."""
        parent = node.parent
        if parent is None or parent.parent is None:
            return None
        return self._hashes[int(parent.block_ids[-1])]

    def event_extra_keys(self, node: Node) -> list[ExtraKeys]:
        """Per block of `node`, as a `BlockStored` event carries them: the untagged salt on a namespace's first
        block, None elsewhere."""
        keys: list[ExtraKeys] = [None] * len(node.block_ids)
        if self.parent_hash(node) is None:
            keys[0] = event_salt(node.namespace)
        return keys

    def store(self, node: Node) -> list[bytes]:
        """Hash the blocks of a new leaf `node` (its parent's blocks are already hashed)."""
        parent_hash = self.parent_hash(node)
        tokens = np.frombuffer(node.token_bytes, dtype="<i4").reshape(-1, self.block_size).tolist()
        salt = namespace_salt(node.namespace) if parent_hash is None else None
        hashes = []
        for block_id, block_tokens in zip(node.block_ids.tolist(), tokens, strict=True):
            parent_hash = block_hash(parent_hash, block_tokens, salt)
            salt = None
            self._hashes[block_id] = parent_hash
            hashes.append(parent_hash)
        return hashes

    def node_hashes(self, node: Node) -> list[bytes]:
        return [self._hashes[b] for b in node.block_ids.tolist()]

    def remove(self, block_ids: npt.NDArray[np.int32] | Sequence[int]) -> list[bytes]:
        """Forget evicted blocks; returns their hashes."""
        return [self._hashes.pop(b) for b in np.asarray(block_ids).tolist()]

    def clear(self) -> None:
        self._hashes.clear()

    def check_against(self, tree_block_ids: npt.NDArray[np.int32] | Sequence[int]) -> None:
        held = set(np.asarray(tree_block_ids).tolist())
        assert held == set(self._hashes), (
            f"hash table out of step with the tree: {len(set(self._hashes) - held)} stale, "
            f"{len(held - set(self._hashes))} missing"
        )


# -- the index digest ------------------------------------------------------------------------------


def mix64(wire: int) -> int:
    """splitmix64's finaliser: spreads a wire hash so sums of many stay uniform (the namespace is in the hash)."""
    z = (wire + 0x9E3779B97F4A7C15) & WIRE_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & WIRE_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & WIRE_MASK
    return z ^ (z >> 31)


def digest_of(wire_hashes: Iterable[int]) -> int:
    """The order-independent digest of a set of cached blocks: sum mod 2^64 of `mix64(wire hash)`.

    Adding or removing one block moves it by one term, so the server keeps it in O(1) per block and a
    router recomputes it from the events it applied; equal sets give equal digests whatever the order.
    """
    return sum(mix64(h) for h in wire_hashes) & WIRE_MASK


# -- the hashing contract --------------------------------------------------------------------------

# 2: the salt tagged ("cache_salt", escaped namespace) as vLLM 0.31+ hashes it (1: the bare namespace). A peer on
# another version names every salted block otherwise: the contract check refuses it instead of missing silently.
HASH_FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HashContract:
    """Everything two parties must share to name a block by the same hash; any difference means misses."""

    block_size: int
    algorithm: str = "sha256_cbor"
    root_seed: str = "vllm-none-hash"
    salt_rule: str = "vllm-tagged-cache-salt-in-first-block-extra-keys"
    tenant_scope_rule: str = "tenant/namespace"
    wire_form: str = "low64"
    format_version: int = HASH_FORMAT_VERSION

    def differences(self, other: HashContract) -> dict[str, tuple[object, object]]:
        """Field -> (self's value, other's value), for every field the two disagree on."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }
