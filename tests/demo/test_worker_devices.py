"""The worker makes every tensor of a step on its pool's device: a CUDA pool used to get CPU copy pairs, tables and
token ids (the kernels refused them). Without a GPU, a pool on the meta device stands in for one."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

import radixkv.demo.paged_attention as paged_attention
import radixkv.demo.worker as worker_module
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.worker import DecodeInput, PrefillInput, Worker, WorkerStep
from radixkv.memory.layout import PoolLayout
from radixkv.memory.storage import KVStorage

BLOCK_SIZE, NUM_BLOCKS = 4, 16


class DevicePool:
    """A `PoolMemory` over one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def layer(self, layer: int) -> torch.Tensor:
        return self.data[layer]

    def kv_scales(self, layer: int) -> torch.Tensor | None:
        return None


def a_step() -> WorkerStep:
    """Every kind of work at once: an offload, a copy, a load, a prefill of a prompt's tail and a decode."""
    prefill = PrefillInput(
        token_ids=[11, 12, 13], num_cached_tokens=2, slots=np.array([2, 3, 4], dtype=np.int64), block_table=[0, 1]
    )  # tokens 2-4 of a prompt
    decode = DecodeInput(token_id=21, position=5, slot=4 * 4 + 1, block_table=[3, 4])  # its 6th token
    return WorkerStep(
        copies=[(5, 6)], prefills=[prefill], decodes=[decode], offloads=[(7, 0)], transfers=[([(8, 1)], [(2, 9)])]
    )


def test_every_tensor_of_a_step_is_made_on_the_pools_device(model: LlamaForCausalLM, monkeypatch):
    """The meta device (shapes, no memory) plays a GPU: a tensor the worker made on the CPU meets the pool or the
    model's weights there and fails; the kernels are replaced by recorders of the devices they are given."""
    c = model.config
    pool = DevicePool(torch.empty(c.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, device="meta"))
    host = torch.zeros(c.num_layers, 2, 4, BLOCK_SIZE, c.num_kv_heads, c.head_dim)  # the host tier, on the CPU
    calls: list[tuple[str, set[torch.device], object]] = []

    def recorder(name: str):
        def kernel(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            pairs = args[2] if name == "swap_blocks" else args[1] if name == "copy_blocks" else None
            calls.append((name, {t.device for t in tensors}, pairs))
            return torch.empty_like(args[0]) if name == "paged_decode_attention" else None

        return kernel

    for module, name in [(worker_module, "copy_blocks"), (worker_module, "swap_blocks")] + [
        (paged_attention, "store_kv"),
        (paged_attention, "paged_decode_attention"),
    ]:
        monkeypatch.setattr(module, name, recorder(name))
    worker = Worker(copy.deepcopy(model).to("meta"), pool, host_data=host)
    out = worker.execute(a_step())
    assert out.prefill_logprobs.device.type == out.decode_logprobs.device.type == "meta"
    assert out.prefill_logprobs.shape == out.decode_logprobs.shape == (1, c.vocab_size)
    kernels = {name for name, _, _ in calls}
    assert kernels == {"copy_blocks", "swap_blocks", "store_kv", "paged_decode_attention"}
    for name, devices, pairs in calls:
        if name == "swap_blocks":
            assert devices == {torch.device("meta"), torch.device("cpu")}, "the pool and the host tier, nothing else"
        else:
            assert devices == {torch.device("meta")}, f"{name} was given a tensor off the pool's device"
        if pairs is not None:  # host pairs: the kernel stages them onto the pool's device itself
            assert isinstance(pairs, list), f"{name}: pairs made into a tensor by the worker, on some device"


def test_a_model_on_another_device_is_refused(model: LlamaForCausalLM):
    c = model.config
    pool = DevicePool(torch.empty(c.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, device="meta"))
    with pytest.raises(ValueError, match="^model: on cpu, the pool on meta"):
        Worker(model, pool)


@pytest.mark.gpu
def test_a_step_on_a_cuda_pool_matches_the_cpu(model: LlamaForCausalLM):
    """The real thing: the same step on a CUDA pool (the Triton kernels) and on a CPU pool (the torch path)."""
    c = model.config
    layout = PoolLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        dtype="float32",
    )
    outputs = []
    for device, backend in (("cpu", "torch"), ("cuda", None)):
        storage = KVStorage.create(layout, device)
        storage.data.copy_(torch.randn(storage.data.shape, generator=torch.Generator().manual_seed(0)))
        host = KVStorage.create_host(dataclasses.replace(layout, num_blocks=10))
        try:
            worker = Worker(copy.deepcopy(model).to(device), storage, backend=backend, host_data=host.data)
            out = worker.execute(a_step())
            outputs.append([t.cpu() for t in (out.prefill_logprobs, out.decode_logprobs)])
        finally:
            host.close()
            storage.close()
    for cpu, cuda in zip(*outputs, strict=True):
        torch.testing.assert_close(cuda, cpu, atol=1e-3, rtol=1e-3)
