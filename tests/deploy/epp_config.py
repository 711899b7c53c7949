"""llm-d-router v0.10.0's endpoint-picker config loader, as far as this repo's config needs it, in Python.

What the loader does (`pkg/epp/config/loader/configloader.go`, `validation.go`, `defaults.go` at v0.10.0):
the YAML becomes JSON and is decoded strictly (apimachinery's `serializer.EnableStrict`: an unknown or a
duplicated field is an error); each plugin's `parameters` are decoded with `DisallowUnknownFields` into its
factory's struct; a plugin without a name takes its type's; names must be unique and types registered; every
`pluginRef` of a scheduling profile must name a plugin (`validateSchedulingProfiles`). The structure and the
parameter structs are `deploy/schemas/endpointpickerconfig-llm-d.ai-v1alpha1.json`; the cross references are
checked here. `data_layer_refs` also checks the data layer's plugin references, which the loader resolves
when it builds the data layer (`buildDataLayerConfig`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA = json.loads(
    (
        Path(__file__).resolve().parents[2] / "deploy" / "schemas" / "endpointpickerconfig-llm-d.ai-v1alpha1.json"
    ).read_text()
)


class Refused(ValueError):
    """What the endpoint picker would fail to start with."""


class _StrictLoader(yaml.SafeLoader):
    """YAML whose mappings refuse a repeated key, as strict decoding refuses a duplicated field."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    keys = [loader.construct_object(k) for k, _ in node.value]
    repeated = {k for k in keys if keys.count(k) > 1}
    if repeated:
        raise Refused(f"duplicate field {sorted(repeated)[0]!r}")
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def decode(text: str) -> dict[str, Any]:
    """The config the picker runs with, or Refused saying why it would not start."""
    try:
        config = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise Refused(f"failed to decode configuration JSON/YAML: {e}") from None
    try:
        jsonschema.Draft202012Validator(SCHEMA).validate(config)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise Refused(f"{where or '(document)'}: {e.message}") from None
    names = [p.get("name") or p["type"] for p in config["plugins"]]
    for name in names:
        if names.count(name) > 1:
            raise Refused(f"duplicate plugin name '{name}'")
    for profile in config["schedulingProfiles"]:
        for ref in profile.get("plugins", []):
            if ref["pluginRef"] not in names:
                raise Refused(f"schedulingProfiles[{profile['name']}] references undefined plugin '{ref['pluginRef']}'")
    for ref in data_layer_refs(config):
        if ref not in names:
            raise Refused(f"dataLayer references undefined plugin '{ref}'")
    return config


def data_layer_refs(config: dict[str, Any]) -> list[str]:
    refs = []
    for source in config.get("dataLayer", {}).get("sources", []):
        refs.append(source["pluginRef"])
        refs += [e["pluginRef"] for e in source.get("extractors", [])]
    return refs


def plugin(config: dict[str, Any], plugin_type: str) -> dict[str, Any]:
    """The one plugin of `plugin_type`, with its parameters ({} when none)."""
    found = [p for p in config["plugins"] if p["type"] == plugin_type]
    assert len(found) == 1, f"exactly one {plugin_type} plugin"
    return {"parameters": {}, **found[0]}
