"""SGLang's RadixCache and its token/paged allocators, loaded from the released wheel, on CPU torch.

Optional setup (never a project dependency; bench_core runs without it and says so):

    pip install --no-deps --target .peers/sglang sglang==0.5.23

Only the files the prefix cache is made of run as written: `radix_cache.py`, `base_prefix_cache.py`,
`cache_init_params.py`, `evict_policy.py` and `allocator/{base,token,paged}.py`. Everything else
they import (metrics, events, platforms, kernels, ...) is stubbed, since none of it runs on the
path driven here: match_prefix, inc/dec_lock_ref, insert, evict, alloc and free.
"""

from __future__ import annotations

import importlib
import sys
import types
from array import array
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
DEFAULT_TARGET = Path(__file__).resolve().parents[1] / ".peers" / "sglang"
_REAL = {
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.allocator.base",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.mem_cache.allocator.paged",
}
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.allocator")


def _allocator_and_tree(peer: types.SimpleNamespace, num_tokens: int, page_size: int) -> tuple[Any, Any]:
    """SGLang's token-to-KV allocator (paged past block 1) and a RadixCache over it, on CPU, as its scheduler
    builds them."""
    import torch

    if page_size == 1:
        allocator = peer.token.TokenToKVPoolAllocator(num_tokens, torch.float16, "cpu", None, False)
    else:
        allocator = peer.paged.PagedTokenToKVPoolAllocator(num_tokens, page_size, torch.float16, "cpu", None, False)
    return allocator, peer.radix.RadixCache.create_simulated(mock_allocator=allocator, page_size=page_size)


class _Anything:
    """What a stubbed name is: callable, subclassable, indexable, falsy."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Anything:
        return _Anything()

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __getitem__(self, key: object) -> _Anything:
        return _Anything()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (_StubBase,)

    def __bool__(self) -> bool:
        return False

    def __or__(self, other: object) -> _Anything:
        return self


class _StubBase:
    def __init_subclass__(cls, **kwargs: object) -> None:
        pass


class _StubFinder:
    """Serves a stub for every module under sglang (or a missing third-party one) not in _REAL."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name in _REAL or name in _PACKAGES:
            return None
        if not name.startswith("sglang") and self._installed(name, path, target):
            return None  # an installed third-party module runs as it is
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def _installed(self, name: str, path: object, target: object) -> bool:
        others = [f for f in sys.meta_path if f is not self and hasattr(f, "find_spec")]
        return any(f.find_spec(name, path, target) is not None for f in others)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__file__ = f"<stub {spec.name}>"
        module.__getattr__ = _stub_attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _num_new_pages(seq_lens: Any, page_size: int, prefix_lens: Any = None, decode: bool = False) -> int:
    """What `sglang.srt.utils.get_num_new_pages` computes (pages past the prefix's), on CPU tensors."""
    if prefix_lens is None or decode:
        return int((seq_lens % page_size == 1).sum())
    return int(((seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size).sum())


def _stub_attribute(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything()


def load(target: Path = DEFAULT_TARGET) -> types.SimpleNamespace | None:
    """SGLang's RadixCache pieces, or None when the wheel is not installed under `target`."""
    source = target / "sglang" / "srt" / "mem_cache" / "radix_cache.py"
    if not source.exists():
        return None
    import torch  # torch before the stubs, so none of its own imports meets one

    # SGLang keeps these index tensors on the GPU; on CPU its small cats and slices must not wait on
    # an intra-op thread pool (on a busy machine that costs 10-100x, and nothing here is parallel).
    torch.set_num_threads(1)

    for name in _PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(target / Path(*name.split(".")))]
        sys.modules[name] = package
    sys.path.insert(0, str(target))
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        policy = importlib.import_module("sglang.srt.mem_cache.evict_policy")
        utils = importlib.import_module("sglang.srt.mem_cache.utils")
        utils.get_eviction_strategy = lambda name, config=None: policy.LRUStrategy()
        utils.split_node_hash_value = lambda *a, **k: (None, None)  # no hashes: KV events are off
        common = importlib.import_module("sglang.srt.utils.common")
        common.ceil_align = lambda x, n: -(-x // n) * n
        utils_pkg = importlib.import_module("sglang.srt.utils")
        utils_pkg.get_bool_env_var = lambda *a, **k: False
        utils_pkg.get_num_new_pages = _num_new_pages
        utils_pkg.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        params = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
        token = importlib.import_module("sglang.srt.mem_cache.allocator.token")
        paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(target))
    return types.SimpleNamespace(radix=radix, base=base, params=params, token=token, paged=paged)


class _Seq:
    """One SGLang request as its scheduler keeps it: the tokens, their KV indices, the locked node."""

    __slots__ = ("tokens", "kv", "node", "protected")

    def __init__(self, tokens: list[int], kv: Any, node: Any, protected: int) -> None:
        self.tokens = tokens  # every token id so far
        self.kv = kv  # [num_pages * page_size] int64 KV indices, page-padded
        self.node = node  # the tree node this request holds locked
        self.protected = protected  # leading tokens whose indices belong to the tree


class Engine:
    """Drives SGLang's RadixCache through the calls its scheduler makes, one request kind at a time.

    open: match_prefix (one token short, as SGLang caps the prefix), inc_lock_ref, allocate the rest
    (evicting when short); fork: SGLang has none, a sibling sample is a request that matches the
    first one's cached prompt; append: allocate the new pages; cache: insert, free the duplicates,
    re-match and move the lock (its `checkpoint`); release: cache, free the uncached tail, unlock.
    """

    def __init__(self, peer: types.SimpleNamespace, num_tokens: int, page_size: int) -> None:
        import torch

        self.torch, self.peer, self.page_size = torch, peer, page_size
        self.allocator, self.tree = _allocator_and_tree(peer, num_tokens, page_size)
        self.num_evicted_tokens = 0

    def _key(self, tokens: list[int], namespace: str) -> Any:
        from array import array

        return self.peer.radix.RadixKey(array("q", tokens), namespace)

    def _alloc(self, n: int) -> Any:
        ps = self.page_size
        n = -(-n // ps) * ps
        if n == 0:
            return self.torch.empty((0,), dtype=self.torch.int64)
        out = self.allocator.alloc(n)
        if out is None:
            short = n - self.allocator.available_size()
            self.num_evicted_tokens += self.tree.evict(self.peer.base.EvictParams(num_tokens=short)).num_tokens_evicted
            out = self.allocator.alloc(n)
            if out is None:
                raise MemoryError(f"SGLang pool cannot supply {n} tokens")
        return out

    def open(self, tokens: list[int], namespace: str) -> tuple[_Seq, int]:
        """Returns the request and its cached prefix length."""
        tree = self.tree
        match = tree.match_prefix(self.peer.base.MatchPrefixParams(key=self._key(tokens[:-1], namespace)))
        node, prefix_len = match.last_device_node, match.device_prefix_len
        tree.inc_lock_ref(node)
        prefix = tree.path_device_indices(node)
        kv = self.torch.cat((prefix, self._alloc(len(tokens) - prefix_len)))
        return _Seq(tokens, kv, node, prefix_len), prefix_len

    def append(self, seq: _Seq, new_tokens: list[int]) -> None:
        ps, before = self.page_size, len(seq.tokens)
        seq.tokens = seq.tokens + new_tokens
        grow = -(-len(seq.tokens) // ps) - -(-before // ps)
        if grow:
            seq.kv = self.torch.cat((seq.kv, self._alloc(grow * ps)))

    def cache(self, seq: _Seq, namespace: str) -> None:
        """Insert every token but the last (its K/V is not written yet), as cache_finished_req does."""
        tree, base = self.tree, self.peer.base
        key = self._key(seq.tokens[:-1], namespace).page_aligned(self.page_size)
        if len(key) <= seq.protected:
            return
        result = tree.insert(base.InsertParams(key=key, value=seq.kv[: len(key)].clone()))
        if result.prefix_len > seq.protected:
            self.allocator.free_segment(seq.kv[seq.protected : result.prefix_len], start_pos=seq.protected)
        node = tree.match_prefix(base.MatchPrefixParams(key=key)).last_device_node
        indices = tree.path_device_indices(node)
        seq.kv[: len(indices)] = indices
        seq.protected = len(indices)
        tree.dec_lock_ref(seq.node)
        tree.inc_lock_ref(node)
        seq.node = node

    def release(self, seq: _Seq, namespace: str) -> None:
        self.cache(seq, namespace)
        tail = seq.kv[seq.protected :]
        if len(tail):
            self.allocator.free_segment(tail, start_pos=seq.protected)
        self.tree.dec_lock_ref(seq.node)


def replay(peer: types.SimpleNamespace, trace: list, num_tokens: int, page_size: int, release_after: int = 32) -> dict:
    """The bench_core trace through SGLang: engine seconds per request kind (a request's release is
    charged to its own kind), hit ratio over prompt tokens, evicted blocks."""
    import collections
    import time

    engine = Engine(peer, num_tokens, page_size)
    seconds: dict[str, float] = collections.defaultdict(float)
    pending: collections.deque = collections.deque()
    requested = hits = 0
    clock = time.perf_counter

    def release(entry: tuple) -> None:
        t0 = clock()
        old, namespace, kind = entry
        for s in old:
            engine.release(s, namespace)
        seconds[kind] += clock() - t0

    for request in trace:
        namespace = request.namespace
        t0 = clock()
        prompt = request.prompt.tolist()
        seq, hit = engine.open(prompt, namespace)
        seqs = [seq]
        if len(request.outputs) > 1:
            engine.cache(seq, namespace)  # the samples hit the prompt the first one wrote
            seqs += [engine.open(prompt, namespace)[0] for _ in request.outputs[1:]]
        for s, output in zip(seqs, request.outputs, strict=True):
            engine.append(s, output.tolist())
        engine.cache(seqs[0], namespace)
        seconds[request.kind] += clock() - t0
        pending.append((seqs, namespace, request.kind))
        if len(pending) > release_after:
            release(pending.popleft())
        requested += len(prompt)
        hits += hit
    while pending:
        release(pending.popleft())
    return {
        "seconds": dict(seconds),
        "total_seconds": sum(seconds.values()),
        "hit_ratio": hits / requested if requested else 0.0,
        "evicted_blocks": engine.num_evicted_tokens // page_size,
    }


# -- SGLang's scheduler path, call for call ------------------------------------------------------------------


class _ReqKv:
    """The `req.kv` fields `RadixCache.checkpoint` reads and writes."""

    __slots__ = ("req_pool_idx", "cache_protected_len", "cache_inserted_len", "swa_evict_floor", "kv_committed_len")

    def __init__(self, row: int) -> None:
        self.req_pool_idx, self.cache_protected_len, self.cache_inserted_len = row, 0, 0
        self.swa_evict_floor = self.kv_committed_len = 0


class _Req:
    """The fields of SGLang's `Req` its cache path reads (`match_kv_cache`, `checkpoint`, `release_kv_cache`)."""

    __slots__ = ("origin_input_ids", "output_ids", "full_untruncated_fill_ids", "extra_key", "cache_salt", "priority",
                 "kv", "lock", "last_node", "prefix_len")  # fmt: skip

    def __init__(self, origin_input_ids: Any, extra_key: str, row: int) -> None:
        self.origin_input_ids = origin_input_ids  # array("q"), as the TokenizerManager builds it
        self.output_ids = self.full_untruncated_fill_ids = None
        self.extra_key, self.cache_salt, self.priority = extra_key, None, None
        self.kv = _ReqKv(row)
        self.lock = self.last_node = None
        self.prefix_len = 0


class _ReqToTokenPool:
    """SGLang's `ReqToTokenPool` as the cache path uses it: an int32 row of KV indices per running request."""

    def __init__(self, torch: Any, num_rows: int, max_context_len: int) -> None:
        self.req_to_token = torch.zeros((num_rows, max_context_len), dtype=torch.int32)
        self.free_slots = list(range(num_rows))

    def write(self, indices: Any, values: Any) -> None:
        self.req_to_token[indices] = values


class Scheduler:
    """SGLang 0.5.23's scheduler driving its RadixCache, for one request at a time (on CPU torch).

    `admit` is `Req.init_next_round_input` (`match_kv_cache`: the key is the prompt as the TokenizerManager's
    `array("q")`, capped one token short by `limit`), the PrefillAdder's `tree_cache.lock(req.last_node)` and
    `alloc_for_extend` (`prefix_device_indices`, eviction of the shortfall, `alloc` at page 1 or `alloc_extend`
    with the last location at larger pages, the row write); it allocates the prompt and the whole output at
    once. `finish` is `release_kv_cache(req, tree_cache, checkpoint=True)`: `refresh_fill_ids`, the real
    `RadixCache.checkpoint` (insert, the prompt-boundary insert, free the duplicates, re-match, move the lock),
    the free of the row past the tree's part, and the unlock.
    """

    def __init__(self, peer: types.SimpleNamespace, num_tokens: int, page_size: int, max_requests: int,
                 max_context_len: int) -> None:  # fmt: skip
        import torch

        self.torch, self.peer, self.page_size = torch, peer, page_size
        self.allocator, self.tree = _allocator_and_tree(peer, num_tokens, page_size)
        self.rows = self.tree.req_to_token_pool = _ReqToTokenPool(torch, max_requests, max_context_len)
        self.num_evicted_tokens = 0

    def _evict_for(self, num_tokens: int) -> None:
        """`evict_from_tree_cache`: evict the shortfall before allocating."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            evicted = self.tree.evict(self.peer.base.EvictParams(num_tokens=short))
            self.num_evicted_tokens += evicted.num_tokens_evicted

    def admit(self, prompt: list[int], num_new_tokens: int, namespace: str) -> tuple[_Req, int]:
        """Returns the request and its cached prefix length."""
        torch, tree, peer, ps = self.torch, self.tree, self.peer, self.page_size
        token_ids = array("q", prompt)
        req = _Req(token_ids, namespace, self.rows.free_slots.pop())
        key = peer.radix.RadixKey(token_ids, namespace, limit=len(token_ids) - 1)
        match = tree.match_prefix(peer.base.MatchPrefixParams(key=key, req=req))
        req.prefix_len = prefix_len = match.device_prefix_len
        req.last_node = match.last_device_node
        req.kv.cache_protected_len = prefix_len
        req.lock = tree.lock(req.last_node)
        prefix = tree.prefix_device_indices(req) if prefix_len else torch.empty((0,), dtype=torch.int64)
        seq_len = len(prompt) + num_new_tokens
        extend = seq_len - prefix_len
        # `alloc_token_slots` at page 1. At larger pages the scheduler calls `alloc_paged_token_slots_extend`; for one
        # request whose prefix ends on a page boundary (a page-aligned match always does) its `alloc_extend` hands out
        # exactly what `alloc` of the whole pages does, and `alloc` is what its GPU kernel costs on the CPU side (the
        # CPU fallback, `alloc_extend_naive`, costs about 0.3 ms more a request).
        self._evict_for(extend if ps == 1 else extend + ps)  # + ps: `alloc_paged_token_slots_extend`'s demand
        out = self.allocator.alloc(-(-extend // ps) * ps)[:extend]
        if out is None:
            raise MemoryError(f"SGLang pool cannot supply {extend} tokens")
        row = req.kv.req_pool_idx
        self.rows.write((row, slice(0, prefix_len)), prefix)
        self.rows.write((row, slice(prefix_len, seq_len)), out)
        req.kv.kv_committed_len = seq_len
        return req, prefix_len

    def finish(self, req: _Req, output: list[int]) -> None:
        """The request wrote `output` (every token's K/V); release it into the cache."""
        tree = self.tree
        req.output_ids = array("q", output)
        req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
        owned = req.kv.kv_committed_len
        tree.checkpoint(req, up_to=owned)
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        start = req.kv.cache_protected_len
        if start < owned:  # `free_kv_row([(cache_protected_len, owned_kv_len)])`
            self.allocator.free_segment(row[start:owned], start_pos=start)
        tree.unlock(req.lock)
        req.lock = None
        self.rows.free_slots.append(req.kv.req_pool_idx)
