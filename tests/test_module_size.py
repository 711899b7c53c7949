"""Every hand-written product module stays at or under 400 lines: one concept per module (STYLE.md, habit 1).

A module that grows past it has a second concept inside it; give that concept its own module, or, where it is one
concept every call crosses whole, name it in EXCEPTIONS with the reason (never move code to fit a count).
Generated protobuf code (`radixkv/v1/*_pb2*`) is not written by hand and is exempt.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
PRODUCT_FOLDERS = ("radixkv", "server", "client", "kernels", "demo", "integrations")
# Modules past MAX_LINES, each one concept, with the reason it stays whole.
EXCEPTIONS = {
    "radixkv/kv_cache.py": "KVCache, the core's API: one method per call, each the first hop of its path",
    "radixkv/tree/radix_tree.py": "the radix tree: token keys, matching, splitting, insert, locks and eviction over "
    "one set of nodes (the policy's order and each owner's own LRU list are two views of the same evictable leaves)",
    "radixkv/tree/host_tier.py": "the host tier: offload on eviction, load back on a match, swap holds, and the one "
    "LRU order of host blocks that all three share (a tier of no blocks is the same class: issue 41's null tier)",
    "radixkv/tree/eviction.py": "the eviction order: each policy's key and the retention tiers every key starts with",
    "radixkv/sequences/append.py": "appending all or none: one plan, its two bodies (a loop, numpy columns) and fork",
    "radixkv/sequences/sequence.py": "live sequences: their records, block tables and the columns of their hot fields",
    "server/rules/checks.py": "a step's checks: sizes, deadlines, counts, namespaces, shares (each refusal it can get)",
    "client/session/client.py": "RadixKVClient: one method per RPC, each the caller's whole contract for that call",
    "radixkv/disk/store.py": "the disk store: its index, LRU byte cap and tenant shares under one lock, which every "
    "object's write (reserve, write, sync, rename, index) and read (verify, or refuse and unindex) crosses",
    "server/rules/service.py": "KVService and the path every change takes: a step checked, then applied all or none",
    "server/rules/sessions.py": "a session: its lease, its sequences and the window of its answered request ids",
    "server/wire/servicer.py": "KVCache on the wire: requests to steps, results to responses, unary and stream",
}


def oversized_modules(root: Path) -> list[str]:
    """`path: N lines` for each hand-written product module over MAX_LINES lines."""
    found = []
    for folder in PRODUCT_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            num_lines = len(path.read_text().splitlines())
            if num_lines > MAX_LINES and str(path.relative_to(root)) not in EXCEPTIONS:
                found.append(f"{path.relative_to(root)}: {num_lines} lines")
    return found


def test_every_product_module_is_at_most_400_lines() -> None:
    assert oversized_modules(ROOT) == []


def test_every_product_folder_is_read() -> None:
    """A renamed folder cannot make the check vacuous."""
    for folder in PRODUCT_FOLDERS:
        assert list((ROOT / folder).rglob("*.py")), folder


def test_the_check_reports_a_long_module_and_skips_generated_code(tmp_path: Path) -> None:
    (tmp_path / "radixkv" / "v1").mkdir(parents=True)
    (tmp_path / "server").mkdir()
    (tmp_path / "radixkv" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "server" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "radixkv" / "v1" / "kvcache_pb2.py").write_text("x = 1\n" * 1000)
    assert oversized_modules(tmp_path) == ["server/long.py: 401 lines"]


def test_every_exception_is_long_and_gives_its_reason() -> None:
    """A named exception that fell back under the limit is dropped from the list, so the list cannot rot."""
    for name, reason in EXCEPTIONS.items():
        assert len((ROOT / name).read_text().splitlines()) > MAX_LINES, f"{name} is within {MAX_LINES}: drop it"
        assert len(reason) > 20, f"{name}: say why it is one concept"
