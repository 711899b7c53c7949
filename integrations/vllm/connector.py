"""`RadixKVConnector`: vLLM's `KVConnectorBase_V1` over radixkv (scheduler side over gRPC, worker side on the pool).

vLLM builds one instance in its scheduler process (role SCHEDULER) and one per worker (role WORKER); they share
only the metadata the scheduler builds each step (`RadixKVMetadata`) and what the worker reports back
(`RadixKVWorkerMetadata`). `kv_connector_extra_config` keys: `radixkv_address` ("HOST:PORT", required),
`radixkv_pool` ("default"), `radixkv_token` (bearer token, with auth on), `radixkv_namespace` ("default").
Run it with `kv_load_failure_policy="recompute"`: vLLM's default fails a request whose load failed.

At start both sides check the pool against the engine (layers, KV heads, head_dim, block size, dtype): a
mismatch raises one ValueError naming both values of each difference. Supported: one worker (no tensor or
pipeline parallelism: the pool holds every KV head of every layer), a dense-attention decoder, the CPU backend
(float32, float16; bfloat16 without AMX) and the token-major CUDA backends (`radixkv.vllm.layouts`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.memory.layout import PoolLayout
from radixkv.vllm.compat import check_supported, external_hit_sources
from radixkv.vllm.events import EventRelay
from radixkv.vllm.layouts import layout_for
from radixkv.vllm.plan import StepPlan
from radixkv.vllm.scheduler_side import SchedulerSide
from radixkv.vllm.worker_side import WorkerSide
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.layers.attention import Attention

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("radixkv.vllm")


@dataclasses.dataclass
class RadixKVMetadata(KVConnectorMetadata):
    plan: StepPlan


@dataclasses.dataclass
class RadixKVWorkerMetadata(KVConnectorWorkerMetadata):
    saved: dict[str, dict[int, bytes]]  # request -> block index -> digest of what the worker wrote

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, RadixKVWorkerMetadata), "one connector's metadata only"
        return RadixKVWorkerMetadata({**self.saved, **other.saved})


def engine_layout(vllm_config: VllmConfig) -> dict[str, object]:
    """What the pool must equal, as the engine sees it."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    return {
        "num_layers": model.get_num_layers(vllm_config.parallel_config),
        "num_kv_heads": model.get_total_num_kv_heads(),
        "head_dim": model.get_head_size(),
        "block_size": cache.block_size,
        "dtype": str(dtype).removeprefix("torch."),
    }


def check_pool(layout: PoolLayout, engine: dict[str, object], where: str) -> None:
    """One ValueError naming every field where the pool and the engine differ, with both values."""
    diffs = [f"{k} {getattr(layout, k)} (radixkv) != {v} (vLLM)" for k, v in engine.items() if getattr(layout, k) != v]
    if diffs:
        fix = (
            f"serve a pool shaped for this engine (radixkv serve --model MODEL --block-size {engine['block_size']} "
            f"--kv-dtype {engine['dtype']})"
        )
        if all(getattr(layout, k) == engine[k] for k in ("num_layers", "num_kv_heads", "head_dim")):
            fix += f", or start vLLM with --block-size {layout.block_size} --dtype {layout.dtype}"
        raise ValueError(f"RadixKVConnector: pool {where} does not match the engine: {', '.join(diffs)}; {fix}")


class RadixKVConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a radixkv server: a shared prefix store that outlives vLLM processes."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        check_supported()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # Our own references, kept from the public hooks: the base class's underscored fields are its own.
        self._config = vllm_config
        self._manager: KVCacheManager | None = None  # bind_kv_cache_manager
        self._plan_meta: RadixKVMetadata | None = None  # bind_connector_metadata, per forward
        transfer = vllm_config.kv_transfer_config
        extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
        address = extra.get("radixkv_address")
        if not address:
            raise ValueError("RadixKVConnector: kv_connector_extra_config needs radixkv_address (HOST:PORT)")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError("RadixKVConnector: one worker only (the pool holds every KV head of every layer)")
        pool = str(extra.get("radixkv_pool", "default"))
        self._block_size = vllm_config.cache_config.block_size
        self._client = RadixKVClient(address, pool=pool, token=extra.get("radixkv_token"))
        try:
            info = self._client.get_pool()
            check_pool(info.layout, engine_layout(vllm_config), f"{pool!r} at {address}")
        except BaseException:
            self._client.close()
            raise
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._saved: dict[str, dict[int, bytes]] = {}  # this step's saves, for build_connector_worker_meta
        self._pool_info = info
        self._events: EventRelay | None = None
        if role == KVConnectorRole.SCHEDULER:
            events_config = vllm_config.kv_events_config
            if events_config is not None and events_config.enable_kv_cache_events:
                self._events = EventRelay(self._client, self._block_size, info.device)
            self._scheduler = SchedulerSide(
                self._client, self._block_size, str(extra.get("radixkv_namespace", "default"))
            )
        else:
            self._client.close()  # the worker maps the pool; the scheduler's session owns every sequence

    # -- scheduler side --------------------------------------------------------------------------------

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's label for where hits came from (0.32 and later call it)."""
        return external_hit_sources(self._pool_info.device, num_external_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None and self._manager is not None
        tokens = scheduler_output.num_scheduled_tokens
        scheduled = [(r.req_id, r.num_computed_tokens + tokens[r.req_id]) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [
            (req_id, num + tokens[req_id])
            for req_id, num in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        ]
        manager = self._manager
        return RadixKVMetadata(self._scheduler.build_plan(scheduled, lambda r: list(manager.get_block_ids(r)[0])))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        self._scheduler.worker_reported(meta.saved if isinstance(meta, RadixKVWorkerMetadata) else {})

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request.request_id)
        return False, None  # the worker copies synchronously: vLLM may free its blocks now

    def take_events(self) -> Iterable[KVCacheEvent]:
        """radixkv's stored and removed blocks since the last call, as vLLM's events (with --kv-events-config)."""
        return self._events.take() if self._events is not None else ()

    # -- worker side -----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = get_layers_from_vllm_config(self._config, Attention)
        names = list(layers)  # model order
        if set(names) != set(kv_caches):
            raise ValueError("RadixKVConnector: every KV cache must belong to an attention layer of the model")
        first = layers[names[0]]
        backend = first.get_attn_backend().get_name()
        layout = layout_for(backend, getattr(first, "isa", None))
        self._worker = WorkerSide(PoolView(self._pool_info), [kv_caches[n] for n in names], layout)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._manager = kv_cache_manager

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, RadixKVMetadata), "metadata built by RadixKVConnector's scheduler side"
        self._plan_meta = connector_metadata

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._plan_meta = None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None and self._plan_meta is not None, "bind_connector_metadata comes first"
        self._worker.load(self._plan_meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copied every layer before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # saved in wait_for_save, all layers in one batch

    def wait_for_save(self) -> None:
        assert self._worker is not None and self._plan_meta is not None, "bind_connector_metadata comes first"
        self._saved = self._worker.save(self._plan_meta.plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        saved, self._saved = self._saved, {}
        return RadixKVWorkerMetadata(saved)

    def shutdown(self) -> None:
        if self._events is not None:
            self._events.close()
        if self._scheduler is not None:
            self._scheduler.close()
            self._client.close()
        if self._worker is not None:
            self._worker.close()
