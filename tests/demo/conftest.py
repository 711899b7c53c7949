"""Fixtures of the demo tests: a random Llama saved by transformers, and a real server process holding its pool."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.server_process import ServerProcess
from radixkv.memory.layout import PoolLayout

BLOCK_SIZE = 4  # small blocks: short prompts still span several, and beams share partial ones


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The models are tiny and the server process shares the CPU: more threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_hf_llama(path: Path, **overrides: object) -> Path:
    """A small random `LlamaForCausalLM` written by transformers itself (`save_pretrained`)."""
    transformers = pytest.importorskip("transformers")
    config = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,  # sharper than the default 0.02: greedy choices are not near-ties
    )
    config.update(overrides)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_llama_factory() -> Callable[..., Path]:
    """`save_hf_llama(path, **config_overrides)`, for tests that need a variant."""
    return save_hf_llama


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_llama(tmp_path_factory.mktemp("hf-llama"))


@pytest.fixture(scope="session")
def model(hf_llama_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(hf_llama_dir)


@pytest.fixture(scope="session")
def layout(model: LlamaForCausalLM) -> PoolLayout:
    c = model.config
    return PoolLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK_SIZE,
        num_blocks=1024,
        dtype="float32",
    )


@pytest.fixture(scope="session")
def server(layout: PoolLayout) -> Iterator[str]:
    with ServerProcess(layout) as address:
        yield address


@pytest.fixture
def client(server: str) -> Iterator[RadixKVClient]:
    with RadixKVClient(server) as c:
        yield c


@pytest.fixture
def view(client: RadixKVClient) -> Iterator[PoolView]:
    with PoolView.from_client(client) as v:
        yield v
