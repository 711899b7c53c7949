"""radixkv's clients: `RadixKVClient` for orchestrators, `PoolView` for co-located workers.

Importing this package never imports torch: an orchestrator needs none. `PoolView` imports it
when a view is opened.
"""

from radixkv.client.client import RadixKVClient
from radixkv.client.events import EventStream, KVEvent, KVEventKind
from radixkv.client.pool_view import PoolInfo, PoolView

__all__ = ["EventStream", "KVEvent", "KVEventKind", "PoolInfo", "PoolView", "RadixKVClient"]
