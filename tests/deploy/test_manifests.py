"""Every manifest under deploy/ validated offline: Kubernetes kinds against the API schemas shipped in
kubernetes-validate (strict: unknown fields fail), the CRDs (InferencePool, PodMonitor) and the
endpoint picker's config against the schemas in deploy/schemas/, which cover the fields this repo
sets (not the whole upstream CRDs). Then the wiring between them: probes, ports, the events topic.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.33"
CRD_SCHEMAS = {
    (p["properties"]["apiVersion"]["const"], p["properties"]["kind"]["const"]): p
    for p in (json.loads(f.read_text()) for f in sorted((DEPLOY / "schemas").glob("*.json")))
}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _validate(doc: dict[str, Any]) -> None:
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    if doc["kind"] == "ConfigMap":
        for text in doc.get("data", {}).values():
            embedded = yaml.safe_load(text)
            if isinstance(embedded, dict) and "apiVersion" in embedded:
                _validate(embedded)


def _find(kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for _, d in _documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


@pytest.mark.parametrize(("filename", "doc"), _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_validates_against_its_schema(filename: str, doc: dict[str, Any]) -> None:
    _validate(doc)


def test_every_kind_has_a_schema_and_the_kinds_expected_are_there() -> None:
    kinds = {d["kind"] for _, d in _documents()}
    assert {"Deployment", "Service", "Secret", "PodMonitor", "InferencePool", "ConfigMap"} <= kinds


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["initContainers"][0].update(restartPolicy=7)),
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["initContainers"][0].update(livenessProbes={})),
        ("InferencePool", lambda d: d["spec"].update(targetPortNumber=8000)),
        ("InferencePool", lambda d: d["spec"]["targetPorts"][0].update(number=70000)),
        ("PodMonitor", lambda d: d["spec"]["podMetricsEndpoints"][0].update(path="metrics")),
    ],
)
def test_a_broken_manifest_is_refused(kind: str, mutate: Any) -> None:
    """The validation above can fail: a wrong type, an unknown field, a value out of range."""
    doc = copy.deepcopy(_find(kind))
    mutate(doc)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        _validate(doc)


def test_a_broken_endpoint_picker_config_is_refused() -> None:
    config = yaml.safe_load(_find("ConfigMap", "radixkv-epp-config")["data"]["epp-config.yaml"])
    del config["plugins"][0]["parameters"]["kvEventsConfig"]["zmqEndpoint"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(config)


def test_the_sidecar_is_native_probed_over_grpc_and_publishes_where_the_picker_listens() -> None:
    pod = _find("Deployment")["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "radixkv")
    assert sidecar["restartPolicy"] == "Always", "a native sidecar: an init container that keeps running"
    flags = dict(a.removeprefix("--").split("=", 1) for a in sidecar["args"] if a.startswith("--"))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["grpc"]["port"] == int(flags["port"])
    assert re.fullmatch(r"kv@\$\(POD_IP\):\d+@\S+", flags["kv-events-topic"])
    assert any(
        e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" for e in sidecar["env"]
    )
    model_port = int(flags["kv-events-topic"].split(":")[1].split("@")[0])
    assert model_port in {p["containerPort"] for c in pod["containers"] for p in c["ports"]}
    picker = yaml.safe_load(_find("ConfigMap", "radixkv-epp-config")["data"]["epp-config.yaml"])
    events = picker["plugins"][0]["parameters"]["kvEventsConfig"]
    assert flags["kv-events-topic"].startswith(events["topicFilter"])
    picker_port = int(events["zmqEndpoint"].rsplit(":", 1)[1])
    service = _find("Service", "radixkv-epp")
    assert flags["kv-events-endpoint"] == f"tcp://{service['metadata']['name']}.default.svc.cluster.local:{picker_port}"
    assert picker_port in {p["port"] for p in service["spec"]["ports"]}
    secret = _find("Secret")["metadata"]["name"]
    assert any(v.get("secret", {}).get("secretName") == secret for v in pod["volumes"])
    pool = _find("InferencePool")["spec"]
    assert pool["targetPorts"][0]["number"] == model_port
    assert pool["endpointPickerRef"]["name"] == service["metadata"]["name"]


def test_the_keeper_holds_the_memory_so_the_server_container_can_restart_alone() -> None:
    pod = _find("Deployment")["spec"]["template"]["spec"]
    names = [c["name"] for c in pod["initContainers"]]
    keeper = pod["initContainers"][names.index("radixkv-keeper")]
    server = pod["initContainers"][names.index("radixkv")]
    assert names.index("radixkv-keeper") < names.index("radixkv"), "the keeper starts (and stops) around the server"
    assert keeper["restartPolicy"] == "Always" and keeper["args"][0] == "keeper"
    assert "ports" not in keeper, "the keeper has no network surface, only its Unix socket"
    state_dir = next(a.split("=", 1)[1] for a in keeper["args"] if a.startswith("--state-dir="))
    for probe in ("startupProbe", "livenessProbe"):
        command = keeper[probe]["exec"]["command"]
        assert command[:2] == ["radixkv", "keeper"] and "--check" in command and f"--state-dir={state_dir}" in command
    server_flags = dict(a.removeprefix("--").split("=", 1) for a in server["args"] if a.startswith("--"))
    assert server_flags["keeper"] == f"{state_dir}/keeper.sock"
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_at(container: dict[str, Any], path: str) -> dict[str, Any]:
        return volumes[next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == path)]

    # The same volumes in both: the socket and state, and /dev/shm; both outlive a container, not the pod.
    for path in (state_dir, "/dev/shm"):
        assert volume_at(keeper, path) is volume_at(server, path)
        assert "emptyDir" in volume_at(keeper, path)
    assert volume_at(keeper, "/dev/shm")["emptyDir"]["medium"] == "Memory"
