"""Issue 42's attacks (hardening, round 3), one test each, against a real server process: what each now gets.

Each bounded a count where the bytes or the work behind it went unbounded: request-id windows
(bytes per tenant and server-wide), Session frames (steps per frame, measured once each, stopped
when the caller leaves), a tenant's cache eviction (its own leaves only), tenant settings (parsed
strictly, never coerced).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _load(Path(__file__).parent / "conftest.py", "hardening3_conftest")  # the server process, the ErrorInfo reader
POOL = "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=256,dtype=float16"


# -- 5. tenant settings parse strictly -----------------------------------------------------------------

# Every key of a [tenants.NAME] table, with a value of the wrong kind that a lenient parser would accept.
BAD_TENANT_VALUES = {
    "token": "token = 12345678",
    "namespaces": 'namespaces = "chat"',  # a string is not a list: it would read as ["c", "h", "a", "t"]
    "max_blocks": 'max_blocks = "64"',
    "max_cached_blocks": "max_cached_blocks = -1",
    "map_pools": 'map_pools = "false"',  # text read as a boolean is true: pool handles for this tenant
    "admin": 'admin = "false"',  # ... and the Debug service, Upgrade included
    "max_tokens_per_second": "max_tokens_per_second = true",
    "publish_kv_events": 'publish_kv_events = "false"',
}


def test_every_tenant_key_has_a_bad_value_here() -> None:
    from radixkv.server.tenant_config import TENANT_KEYS

    assert sorted(BAD_TENANT_VALUES) == sorted(TENANT_KEYS)


@pytest.mark.parametrize("key", sorted(BAD_TENANT_VALUES))
def test_a_tenant_setting_of_the_wrong_kind_stops_the_server_at_start_with_the_key_named(key, tmp_path) -> None:  # type: ignore[no-untyped-def]
    lines = [f"[tenants.mallory]\n{BAD_TENANT_VALUES[key]}\n"]
    if key != "token":
        lines.append('token = "mallory-token-000000"\n')
    (tmp_path / "tenants.toml").write_text("".join(lines))
    with pytest.raises(RuntimeError) as caught:  # the process exits before it serves
        proc = _suite.ServerProcess(["--pool", POOL, "--auth-tokens", str(tmp_path / "tenants.toml")],
                                    tmp_path / "server.log")  # fmt: skip
        proc.stop()
    assert "exited" in str(caught.value) and "mallory" in str(caught.value) and key in str(caught.value)


def test_a_stray_key_in_the_auth_tokens_file_stops_the_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "tenants.toml").write_text('admin = false\n[tenants.acme]\ntoken = "acme-token-0000"\n')
    with pytest.raises(RuntimeError) as caught:
        proc = _suite.ServerProcess(["--pool", POOL, "--auth-tokens", str(tmp_path / "tenants.toml")],
                                    tmp_path / "server.log")  # fmt: skip
        proc.stop()
    assert "exited" in str(caught.value) and "unknown top-level keys ['admin']" in str(caught.value)
