"""Tenant settings and top-level server keys parse strictly: the wrong kind is refused with the key named."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from radixkv.server.rules.config import ServerConfig, config_from_mapping
from radixkv.server.rules.tenant_config import TENANT_KEYS, TenantConfig, auth_tokens_tenants, tenants_from_mapping

BAD = {  # every key: values of a kind it must refuse, as TOML spells them
    "token": ["12", '""', '" padded "', "true", '["a"]', '"tab\\there"'],
    "namespaces": ['"chat"', "[]", "[1]", '["bad name"]', '["' + "x" * 130 + '"]', "true"],
    "max_blocks": ['"64"', "-1", "1.5", "true"],
    "max_cached_blocks": ['"64"', "-1", "2.0", "false"],
    "map_pools": ['"false"', '"true"', "0", "1", '"no"'],
    "admin": ['"false"', "0", "1", "[]"],
    "max_tokens_per_second": ["true", '"100"', "0", "-5", "inf", "nan"],
    "publish_kv_events": ['"false"', "0"],
}
GOOD = {
    "token": '"a-token-00000"',
    "namespaces": '["chat", "code/x", "*"]',
    "max_blocks": "0",
    "max_cached_blocks": "4096",
    "map_pools": "true",
    "admin": "false",
    "max_tokens_per_second": "2.5",
    "publish_kv_events": "false",
}


def _tenants(body: str) -> tuple[TenantConfig, ...]:
    return tenants_from_mapping(tomllib.loads(f"[tenants.acme]\n{body}")["tenants"])


def test_every_key_is_covered() -> None:
    assert sorted(BAD) == sorted(GOOD) == sorted(TENANT_KEYS)


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, vs in BAD.items() for v in vs])
def test_a_bad_value_is_refused_with_the_tenant_and_key_named(key: str, value: str) -> None:
    body = "".join(f"{k} = {GOOD[k] if k != key else value}\n" for k in TENANT_KEYS)
    with pytest.raises(ValueError, match=f"tenant 'acme': {key}"):
        _tenants(body)


def test_good_values_parse_as_given() -> None:
    (acme,) = _tenants("".join(f"{k} = {v}\n" for k, v in GOOD.items()))
    assert acme == TenantConfig(
        name="acme",
        token="a-token-00000",
        namespaces=("chat", "code/x", "*"),
        max_blocks=0,
        max_cached_blocks=4096,
        map_pools=True,
        admin=False,
        max_tokens_per_second=2.5,
        publish_kv_events=False,
    )


@pytest.mark.parametrize("document", ["tenants = 3", "[tenants]\nacme = 3", "[tenants.acme]\nnamespaces = []"])
def test_a_malformed_tenants_table_is_refused(document: str) -> None:
    with pytest.raises(ValueError, match="tenant"):
        tenants_from_mapping(tomllib.loads(document)["tenants"])


def test_the_auth_tokens_file_holds_only_tenants() -> None:
    with pytest.raises(ValueError, match=r"unknown top-level keys \['max_sessions'\]"):
        auth_tokens_tenants(tomllib.loads("max_sessions = 3\n[tenants.a]\ntoken = 'x'"))


_SERVER_KEYS = [f for f in dataclasses.fields(ServerConfig) if f.name not in ("pools", "tenants")]


@pytest.mark.parametrize("field", _SERVER_KEYS, ids=lambda f: f.name)
def test_a_top_level_key_of_the_wrong_kind_is_refused(field: dataclasses.Field) -> None:  # type: ignore[type-arg]
    kind = str(field.type)
    bad = '"false"' if kind == "bool" else "true" if "str" not in kind else "3"
    pools = "[pools.p]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 4\nnum_blocks = 8\n"
    with pytest.raises(ValueError, match=f"^{field.name} = "):
        config_from_mapping(tomllib.loads(f"{field.name} = {bad}\n{pools}"))
