"""radixkv's clients: `RadixKVClient` for orchestrators, `PoolView` for co-located workers, `Router` for fleets.

Importing this package never imports torch: an orchestrator needs none. `PoolView` imports it
when a view is opened.
"""

from radixkv.client.client import RadixKVClient
from radixkv.client.errors import HashContractMismatch
from radixkv.client.events import EventStream, KVEvent, KVEventKind
from radixkv.client.match_explanation import MatchExplanation
from radixkv.client.pool_info import PoolInfo
from radixkv.client.pool_view import PoolView
from radixkv.client.router import Balance, InstanceStatus, NoInstanceAvailable, Router
from radixkv.client.verify import VerifyResult

__all__ = [
    "Balance",
    "EventStream",
    "HashContractMismatch",
    "InstanceStatus",
    "KVEvent",
    "KVEventKind",
    "MatchExplanation",
    "NoInstanceAvailable",
    "PoolInfo",
    "PoolView",
    "RadixKVClient",
    "Router",
    "VerifyResult",
]
