"""`RadixKVClient.match(..., explain=True)` and `open(..., explain=True)`: the cached prefix and why it ends there."""

from __future__ import annotations

import dataclasses

from radixkv.v1 import kvcache_pb2 as pb

_PREFIX = "MISS_REASON_"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MatchExplanation:
    """`reason` is one of FULLY_CACHED, NEVER_CACHED, EVICTED, PARTIAL_BLOCK, OTHER_NAMESPACE, LAST_TOKEN
    (open only), HOST_TIER (match only: the prefix continues in the host tier, which an open loads back);
    UNSPECIFIED for an open retried after a lost reply (answered without explanation)."""

    num_cached_tokens: int
    reason: str
    block_index: int  # the first uncached block
    evicted_at_unix_ns: int = 0  # EVICTED: when
    other_namespace: str = ""  # OTHER_NAMESPACE: where the same tokens are cached
    num_host_cached_tokens: int = 0  # Match only: past num_cached_tokens, in the host tier (vLLM's medium "CPU")
    num_disk_cached_tokens: int = 0  # Match only: past those, in the disk tier (vLLM's medium "STORAGE")

    @classmethod
    def from_response(cls, response: pb.MatchResponse | pb.OpenedSequence | pb.StepOpened) -> MatchExplanation:
        return cls(
            num_cached_tokens=response.num_cached_tokens,
            reason=pb.MissReason.Name(response.miss_reason).removeprefix(_PREFIX),
            block_index=response.miss_block_index,
            evicted_at_unix_ns=response.evicted_at_unix_ns,
            other_namespace=response.other_namespace,
            **(
                {
                    "num_host_cached_tokens": response.num_host_cached_tokens,
                    "num_disk_cached_tokens": response.num_disk_cached_tokens,
                }
                if isinstance(response, pb.MatchResponse)
                else {}
            ),
        )
