"""radixkv as vLLM's KV connector: `RadixKVConnector`, loaded by vLLM from `kv_connector_module_path="radixkv.vllm"`.

    KVTransferConfig(kv_connector="RadixKVConnector", kv_connector_module_path="radixkv.vllm", kv_role="kv_both",
                     kv_connector_extra_config={"radixkv_address": "HOST:PORT", "radixkv_pool": "default"})

Only `radixkv.vllm.connector` (and `events` and `compat`, which it imports) import vLLM, and only when the class
is asked for: `import radixkv` never pulls vLLM in, and `radixkv.vllm.layouts` / `radixkv.vllm.plan` (torch,
plain Python) serve without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RadixKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "RadixKVConnector":
        from radixkv.vllm.connector import RadixKVConnector

        return RadixKVConnector
    raise AttributeError(f"module 'radixkv.vllm' has no attribute {name!r}")
