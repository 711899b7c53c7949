"""radixkv's clients: `RadixKVClient` for orchestrators, `PoolView` for co-located workers, `Router` for fleets.

Importing this package never imports torch: an orchestrator needs none. `PoolView` imports it
when a view is opened.
"""

from radixkv.client.errors import HashContractMismatch
from radixkv.client.fleet.events import EventStream, KVEvent, KVEventKind
from radixkv.client.fleet.router import Balance, InstanceStatus, NoInstanceAvailable, Router
from radixkv.client.fleet.verify import VerifyResult
from radixkv.client.session.client import RadixKVClient
from radixkv.client.session.match_explanation import MatchExplanation
from radixkv.client.worker.pool_info import PoolInfo
from radixkv.client.worker.pool_view import PoolView

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
