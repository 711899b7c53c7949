"""What a pool states about its index: the hash contract and the digests of its cached blocks (`Verify`).

A router or client that hashes prompts itself must hash them as the pool does; `check_contract`
refuses an instance whose contract differs (`HashContractMismatch`), where a mismatch would
otherwise show only as every lookup missing. The digests let anyone that mirrors a pool's index
(`PrefixIndex`, or an external router) check it against the pool without a dump.
"""

from __future__ import annotations

import dataclasses

from radixkv.client.errors import HashContractMismatch
from radixkv.tree.block_hash import HashContract
from radixkv.v1 import kvcache_pb2 as pb


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyResult:
    """A pool's digests as the caller may see them: only its own namespaces (its own names for them)."""

    digests: dict[str, int]  # namespace -> digest of its cached blocks
    num_blocks: dict[str, int]  # namespace -> its cached blocks
    digest: int  # of all of them
    epoch: int
    seq: int  # the event count they are current to: the caller tenant's (the pool's, auth off), no one else's
    hash_contract: HashContract


def contract_from_wire(c: pb.HashContract) -> HashContract:
    return HashContract(
        block_size=c.block_size,
        algorithm=c.algorithm,
        root_seed=c.root_seed,
        salt_rule=c.salt_rule,
        tenant_scope_rule=c.tenant_scope_rule,
        wire_form=c.wire_form,
        format_version=c.format_version,
    )


def verify_result(r: pb.VerifyResponse) -> VerifyResult:
    return VerifyResult(
        digests={n.namespace: n.digest for n in r.namespaces},
        num_blocks={n.namespace: n.num_blocks for n in r.namespaces},
        digest=r.digest,
        epoch=r.epoch,
        seq=r.seq,
        hash_contract=contract_from_wire(r.hash_contract),
    )


def check_contract(endpoint: str, ours: HashContract, theirs: HashContract) -> None:
    """Raises HashContractMismatch naming every field where `theirs` (the instance's) differs from `ours`."""
    differences = ours.differences(theirs)
    if differences:
        raise HashContractMismatch(endpoint, differences)
