"""How many rooms a request crosses: the files (and functions) a call's radixkv frames run in, traced, against a target.

A new maintainer follows a call by reading every file it passes through; each extra hop is a file to open and
(measured in benchmarks/bench_core.py's per-request row) per-call overhead. The counts are read with
`sys.settrace` (calls only, frames in this repository's product folders only) and fail above the targets
(issue 41), so the map cannot silently grow:
- an in-process `KVCache.open` crosses at most 7 files;
- the README's six in-process calls (open, commit, fork, append_batch, release_many, open) at most 12;
- a unary `OpenSequences` on a served pool runs in at most 10 server modules (the core's files besides).
The server is built in this process (`create_server`) for the trace only, so its RPC thread can be traced;
only the frames of the thread that ran the call count.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from radixkv import KVCache

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tuple(
    str(ROOT / folder) + "/" for folder in ("radixkv", "server", "client", "kernels", "demo", "integrations")
)
GENERATED = str(ROOT / "radixkv" / "v1") + "/"

MAX_OPEN_FILES = 7
MAX_README_FILES = 12
MAX_OPEN_SEQUENCES_SERVER_MODULES = 10


class Trace:
    """The (thread, file, function) of every call into product code while `recording()`.

    `sys.settrace` reaches only the thread that calls it and `threading.settrace` only threads started after:
    a server's RPC threads are traced by installing `on_call` before the server starts (`threading.settrace`),
    and record only while `recording()` is on."""

    def __init__(self) -> None:
        self.calls: set[tuple[int, str, str]] = set()
        self.active = False

    def on_call(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.active and event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PRODUCT) and not path.startswith(GENERATED):
                self.calls.add((threading.get_ident(), path.removeprefix(str(ROOT) + "/"), frame.f_code.co_qualname))

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.calls.clear()
        self.active = True
        sys.settrace(self.on_call)
        try:
            yield
        finally:
            sys.settrace(None)
            self.active = False

    def files(self, thread: int | None = None, under: str = "") -> list[str]:
        return sorted({f for t, f, _ in self.calls if (thread is None or t == thread) and f.startswith(under)})

    def functions(self, thread: int | None = None) -> int:
        return len({(f, q) for t, f, q in self.calls if thread is None or t == thread})

    def thread_of(self, qualname: str) -> int:
        [thread] = {t for t, _, q in self.calls if q == qualname}
        return thread


PROMPT = list(range(1000, 1040))


def test_an_in_process_open_crosses_few_files() -> None:
    cache = KVCache(num_blocks=1024, block_size=16)
    trace = Trace()
    with trace.recording():
        cache.open(PROMPT, namespace="tenant-a")
    files = trace.files()
    print(f"in-process open: {len(files)} files, {trace.functions()} functions: {files}")
    assert "radixkv/kv_cache.py" in files  # the trace sees the core (a moved file cannot make this vacuous)
    assert len(files) <= MAX_OPEN_FILES, files


def test_the_readmes_six_calls_cross_few_files() -> None:
    """The README's in-process block (tests/test_readme.py runs it as written)."""
    cache = KVCache(num_blocks=1024, block_size=16)
    trace = Trace()
    with trace.recording():
        seq = cache.open(PROMPT, namespace="tenant-a")
        cache.commit([seq.seq_id], [len(PROMPT)])
        beams = cache.fork(seq.seq_id, 4)
        cache.append_batch(beams, [1, 1, 1, 1], [7, 8, 9, 10])
        cache.release_many([seq.seq_id, *beams], cache=True)
        again = cache.open(PROMPT, namespace="tenant-a")
    assert again.num_cached_tokens == 32
    files = trace.files()
    print(f"README's six calls: {len(files)} files, {trace.functions()} functions: {files}")
    assert len(files) <= MAX_README_FILES, files


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Trace]]:
    """A server in this process, every thread it starts traced (recording only inside `recording()`)."""
    from radixkv.server.process.app import create_server
    from radixkv.server.process.flags import parse_args

    pool = "default:num_layers=1,num_kv_heads=1,head_dim=8,block_size=16,dtype=float32,num_blocks=256"
    config, _ = parse_args(["serve", "--pool", pool, "--log-level", "warning"])
    trace = Trace()
    threading.settrace(trace.on_call)  # the RPC threads start on the first calls
    try:
        server, port = create_server(config, "127.0.0.1:0")
        server.start()
        try:
            yield f"127.0.0.1:{port}", trace
        finally:
            server.stop(0)
    finally:
        threading.settrace(None)  # type: ignore[arg-type]


def test_a_unary_open_sequences_crosses_few_server_modules(served: tuple[str, Trace]) -> None:
    from radixkv.client import RadixKVClient

    address, trace = served
    with RadixKVClient(address, timeout=60) as client:
        client.open(PROMPT, "chat")  # warm: the first call of a server builds its handler caches
        with trace.recording():
            client.open(PROMPT, "chat", max_new_tokens=16)
    thread = trace.thread_of("KVCacheServicer.OpenSequences")
    server = trace.files(thread, under="server/")
    core = trace.files(thread, under="radixkv/")
    functions = trace.functions(thread)
    print(f"unary OpenSequences: {len(server)} server modules, {len(core)} core files, {functions} functions: {server}")
    assert "server/wire/servicer.py" in server
    assert len(server) <= MAX_OPEN_SEQUENCES_SERVER_MODULES, server
