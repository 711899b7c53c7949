"""Every Python code block of README.md runs here, as written, and each asserts what its comments promise.

The blocks are read from the README when the tests are collected, so a new one is picked up. What a
fenced block's info string says:

- ```python check=NAME: runs as written, then `CHECKS[NAME]` asserts what its comments promise. Two
  substitutions only, both left to the reader by the README: the names a model, a tokenizer or an
  earlier step would give (a prompt, the model's K/V) come from the check's inputs, and an address
  the block dials ("127.0.0.1:50051", the fleet's "10.0.0.x:50051") becomes a `radixkv serve`
  process this module starts (`ServerProcess`).
- ```python excerpt=PATH: a verbatim excerpt of PATH (at any one indent), whose own tests run it; checked to be one.
- any other language (```bash, ```text, ```yaml, none): not run; shell commands, output, pictures.

A Python block with neither, a check whose block is gone, or Python in an indented (unfenced) block
fails here, naming the README line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.server.process.spawn import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>.*)$")
INDENTED_PYTHON = re.compile(r"^ {4,}(from [\w.]+ import |import \w)")


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    language: str
    attrs: dict[str, str]
    source: str  # dedented by the fence's indent (a block inside a list item)

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def code_blocks(text: str) -> tuple[list[Block], list[int]]:
    """The fenced code blocks, and the lines of Python found outside any fence (an indented block)."""
    blocks, unfenced, lines, i = [], [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            if INDENTED_PYTHON.match(lines[i]):
                unfenced.append(i + 1)
            i += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"].split()
        body, j = [], i + 1
        while j < len(lines) and not re.fullmatch(rf" *{fence[0]}{{{len(fence)},}}\s*", lines[j]):
            body.append(lines[j].removeprefix(indent))
            j += 1
        attrs = dict(word.split("=", 1) for word in info[1:] if "=" in word)
        blocks.append(Block(i + 1, info[0] if info else "", attrs, "\n".join(body) + "\n"))
        i = j + 1
    return blocks, unfenced


BLOCKS, UNFENCED = code_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.language == "python"]


def run(block: Block, inputs: dict[str, Any] | None = None, addresses: dict[str, str] | None = None) -> dict[str, Any]:
    """Execute `block` as a module would, its reader's `inputs` defined and `addresses` replaced; its globals."""
    source = block.source
    for written, real in (addresses or {}).items():
        assert written in source, f"{block}: the block no longer dials {written}"
        source = source.replace(written, real)
    namespace: dict[str, Any] = {"__name__": "readme_block", **(inputs or {})}
    exec(compile(source, str(block), "exec"), namespace)
    return namespace


# -- the servers the blocks dial ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`radixkv serve` with no flags: the pool the README's client blocks assume."""
    log = tmp_path_factory.mktemp("readme") / "serve.log"
    with ServerProcess(["--log-level", "warning"], log) as server:
        yield server


@pytest.fixture(scope="module")
def second_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Another instance for the fleet's Router (a small pool of the same block size)."""
    log = tmp_path_factory.mktemp("readme") / "serve2.log"
    pool = "default:num_layers=1,num_kv_heads=1,head_dim=8,block_size=16,num_blocks=64,dtype=float16"
    with ServerProcess(["--pool", pool, "--log-level", "warning"], log) as server:
        yield server


# -- what each block promises ------------------------------------------------------------------------------


def check_in_process(block: Block, request: pytest.FixtureRequest) -> None:
    ns = run(block)
    cache, seq, beams, step, again = ns["cache"], ns["seq"], ns["beams"], ns["step"], ns["again"]
    assert seq.num_cached_tokens == 0 and len(seq.block_table) == 3 and len(seq.slots) == 40
    assert len(beams) == 4
    # Every beam writes into the shared partial last block: it is copied first, then the slot is in the copy.
    assert [src for src, _, _ in step.copies] == [seq.block_table[2]] * 4
    assert [slot // 16 for slot in step.slots] == [dst for _, dst, _ in step.copies]
    assert again.num_cached_tokens == 32, "the next request hits both full blocks of the prompt"
    assert list(again.block_table[:2]) == list(seq.block_table[:2])
    cache.release(again.seq_id, cache=False)
    stats = cache.stats()
    assert (stats.num_live_sequences, stats.num_blocks_cached) == (0, 2)
    cache.check_invariants()


def check_client_and_kernels(block: Block, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue("default_server")
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.float16)

    prompt = list(range(2000, 2040))
    inputs = dict(prompt_token_ids=prompt, next_token=7, k=randn(40, 3, 64), v=randn(40, 3, 64))
    inputs.update(q=randn(1, 9, 64), k_new=randn(1, 3, 64), v_new=randn(1, 3, 64))
    ns = run(block, inputs, {"127.0.0.1:50051": server.address})

    with RadixKVClient(server.address) as client, PoolView.from_client(client) as pool:
        layout = pool.layout
        assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype) == (
            30, 3, 64, 16, "float16"
        ), "radixkv serve with no flags: SmolLM2-135M's shape"  # fmt: skip
        assert pool.kv_scales(0) is None, "not an fp8 pool"
        k_cache, v_cache = (pool.layer(0)[i].reshape(-1, 3, 64) for i in (0, 1))  # [num_slots, kv_heads, head_dim]
        slots = torch.cat([ns["prefill"].slots, ns["t"].slots])
        k_all, v_all = torch.cat([inputs["k"], inputs["k_new"]]), torch.cat([inputs["v"], inputs["v_new"]])
        assert torch.equal(k_cache[slots], k_all) and torch.equal(v_cache[slots], v_all), "store_kv wrote them"
    assert ns["batch"].num_tokens == [41] and len(ns["t"].copies) == 0  # a lone sequence copies nothing
    # The decode attention: the new token's query over all 41 tokens, each query head on its KV head (GQA 9/3).
    q = inputs["q"].float()[0]  # [9, 64]
    kv_head = torch.arange(9) // 3
    logits = torch.einsum("hd,thd->ht", q, k_all.float()[:, kv_head]) * 64**-0.5  # [9, 41]
    expected = torch.einsum("ht,thd->hd", logits.softmax(-1), v_all.float()[:, kv_head])
    assert ns["out"].shape == (1, 9, 64)
    torch.testing.assert_close(ns["out"][0].float(), expected, atol=2e-3, rtol=2e-3)


def check_async_step(block: Block, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue("default_server")
    prompt_a, prompt_b = list(range(3000, 3020)), list(range(4000, 4040))  # prompt_b: two full blocks and 8 tokens
    new_prompt = list(range(5000, 5010))
    inputs = dict(prompt_a=prompt_a, prompt_b=prompt_b, new_prompt=new_prompt, next_token=9)
    ns = run(block, inputs, {"127.0.0.1:50051": server.address})
    assert len(ns["prefill_slots"]) == len(new_prompt), "the admission's slots: nothing of it was cached"
    assert len(ns["decode_slots"]) == 1 and len(ns["copies"]) == 0
    with RadixKVClient(server.address) as client:
        assert client.match(prompt_b, "chat") == 32, "the finished request's written full blocks stay cached"
        assert client.match(prompt_a, "chat") == 0, "a request ended by closing its session is not cached"
    assert asyncio.iscoroutinefunction(ns["main"])


def check_router(block: Block, request: pytest.FixtureRequest) -> None:
    first: ServerProcess = request.getfixturevalue("default_server")
    second: ServerProcess = request.getfixturevalue("second_server")
    addresses = {"10.0.0.1:50051": first.address, "10.0.0.2:50051": second.address}
    ns = run(block, {"token_ids": list(range(6000, 6040))}, addresses)
    assert ns["endpoint"] in {first.address, second.address}, "one of the fleet's instances"


CHECKS: dict[str, Callable[[Block, pytest.FixtureRequest], None]] = {
    "in-process": check_in_process,
    "client-and-kernels": check_client_and_kernels,
    "async-step": check_async_step,
    "router": check_router,
}


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_a_python_block_runs_as_written(block: Block, request: pytest.FixtureRequest) -> None:
    if "excerpt" in block.attrs:
        path = ROOT / block.attrs["excerpt"]
        text = path.read_text()  # the excerpt may be indented there (a function's body): any one indent
        found = any(textwrap.indent(block.source, " " * n) in text for n in range(0, 17, 4))
        assert found, f"{block} is no longer a verbatim excerpt of {path.name}"
        return
    assert block.attrs.get("check") in CHECKS, f"{block}: mark it check=NAME and add its check to {__name__}"
    CHECKS[block.attrs["check"]](block, request)


def test_every_check_has_its_block_and_no_python_is_unfenced() -> None:
    assert sorted(CHECKS) == sorted(b.attrs["check"] for b in PYTHON if "check" in b.attrs)
    assert UNFENCED == [], f"README.md lines {UNFENCED}: fence Python as ```python check=NAME so it runs here"


def test_the_parser_reads_fences_inside_list_items_and_skips_other_languages() -> None:
    text = "x\n\n```bash\nmake test\n```\n- item:\n\n  ```python check=a\n  x = 1\n    y = 2\n  ```\n\n    import os\n"
    blocks, unfenced = code_blocks(text)
    assert [(b.line, b.language, b.attrs, b.source) for b in blocks] == [
        (3, "bash", {}, "make test\n"),
        (8, "python", {"check": "a"}, "x = 1\n  y = 2\n"),
    ]
    assert unfenced == [13]
