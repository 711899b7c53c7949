"""Every manifest under deploy/ checked offline against the upstream versions deploy/versions.json pins.

Kubernetes kinds against kubernetes-validate's strict schemas (unknown fields fail) of the oldest and newest
Kubernetes pinned; the InferencePool and PodMonitor against deploy/schemas/, written from the pinned CRDs; the
endpoint picker's config decoded as llm-d-router v0.10.0's loader decodes it (`epp_config.py`). Then the
wiring between them: probes, ports, the events topic and model, the tokenizer, who may reach the events.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from radixkv.planning.model_shape import MODEL_SHAPES, known_model

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
VERSIONS = json.loads((DEPLOY / "versions.json").read_text())
CRD_SCHEMAS = {
    (p["properties"]["apiVersion"]["const"], p["properties"]["kind"]["const"]): p
    for p in (json.loads(f.read_text()) for f in sorted((DEPLOY / "schemas").glob("*.json")))
    if p["properties"]["kind"]["const"] != "EndpointPickerConfig"
}


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


epp = _sibling("epp_config")


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
        for version in VERSIONS["kubernetes"]["validated"]:
            kubernetes_validate.validate(doc, version, strict=True)
    if doc["kind"] == "ConfigMap" and "epp-config.yaml" in doc.get("data", {}):
        epp.decode(doc["data"]["epp-config.yaml"])


def _find(kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for _, d in _documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def _picker_config() -> dict[str, Any]:
    return yaml.safe_load(_find("ConfigMap", "radixkv-epp-config")["data"]["epp-config.yaml"])


def _sidecar_flags() -> dict[str, str]:
    pod = _find("Deployment", "llm")["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "radixkv")
    return dict(
        a.removeprefix("--").split("=", 1) if "=" in a else (a.removeprefix("--"), "") for a in sidecar["args"][1:]
    )


def _container(deployment: str, name: str) -> dict[str, Any]:
    pod = _find("Deployment", deployment)["spec"]["template"]["spec"]
    return next(c for c in (*pod.get("initContainers", ()), *pod["containers"]) if c["name"] == name)


@pytest.mark.parametrize(("filename", "doc"), _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_validates_against_its_schema(filename: str, doc: dict[str, Any]) -> None:
    _validate(doc)


def test_every_kind_has_a_schema_and_the_kinds_expected_are_there() -> None:
    kinds = {d["kind"] for _, d in _documents()}
    assert {
        "Deployment", "Service", "Secret", "PodMonitor", "InferencePool", "ConfigMap", "NetworkPolicy",
        "ServiceAccount", "Role", "RoleBinding",
    } <= kinds  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["initContainers"][0].update(restartPolicy=7)),
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["initContainers"][0].update(livenessProbes={})),
        ("NetworkPolicy", lambda d: d["spec"]["ingress"][0].update(sources=[])),
        ("InferencePool", lambda d: d["spec"].update(targetPortNumber=8000)),  # v1alpha2's field, gone in v1
        ("InferencePool", lambda d: d["spec"]["targetPorts"][0].update(number=70000)),
        ("InferencePool", lambda d: d["spec"]["targetPorts"].append({"number": d["spec"]["targetPorts"][0]["number"]})),
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].pop("port")),  # a Service needs a port (CEL)
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].update(failureMode="FailSoft")),
        ("PodMonitor", lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds")),
    ],
)
def test_a_broken_manifest_is_refused(kind: str, mutate: Any) -> None:
    """The validation above can fail: a wrong type, an unknown field, a value out of range, a CEL rule."""
    doc = copy.deepcopy(_find(kind))
    mutate(doc)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        _validate(doc)


def test_the_picker_config_decodes_as_v0_10_decodes_it_and_the_old_layout_does_not() -> None:
    text = _find("ConfigMap", "radixkv-epp-config")["data"]["epp-config.yaml"]
    config = epp.decode(text)
    producer = epp.plugin(config, "precise-prefix-cache-producer")["parameters"]
    assert producer["tokenProcessorConfig"]["blockSizeTokens"] == 16, "tokenProcessorConfig beside indexerConfig"
    old = copy.deepcopy(config)  # the layout before v0.10: tokenProcessorConfig inside indexerConfig
    old_producer = epp.plugin(old, "precise-prefix-cache-producer")["parameters"]
    old_producer["indexerConfig"]["tokenProcessorConfig"] = old_producer.pop("tokenProcessorConfig")
    with pytest.raises(epp.Refused, match="indexerConfig.*tokenProcessorConfig"):
        epp.decode(yaml.safe_dump(old))


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda t: t.replace("topicFilter:", "topicFiltr:"), "topicFiltr"),
        (lambda t: t.replace("blockSizeTokens: 16", 'blockSizeTokens: "16"'), "is not of type 'integer'"),
        (lambda t: t.replace("plugins:\n", "plugins:\n  - type: no-such-plugin\n", 1), "no-such-plugin"),
        (
            lambda t: t.replace("- pluginRef: queue-scorer", "- pluginRef: queue-scorr"),
            "undefined plugin 'queue-scorr'",
        ),
        (lambda t: t.replace("- pluginRef: precise-prefix-cache-producer", "- pluginRef: nobody"), "undefined plugin"),
        (lambda t: t.replace("concurrency: 4", "concurrency: 4\n        concurrency: 8"), "duplicate field"),
        (lambda t: t.replace("kind: EndpointPickerConfig", "kind: EndpointPickerConfig\nparser: {}"), "parser"),
        (lambda t: t.replace("  - type: queue-scorer", "  - type: queue-scorer\n  - type: queue-scorer"), "dup"),
    ],
)
def test_a_broken_picker_config_is_refused(edit: Any, why: str) -> None:
    text = _find("ConfigMap", "radixkv-epp-config")["data"]["epp-config.yaml"]
    edited = edit(text)
    assert edited != text, "the edit applies"
    with pytest.raises(epp.Refused, match=re.escape(why) if why != "dup" else "duplicate plugin name"):
        epp.decode(edited)


def test_the_pool_is_shaped_for_the_model_the_topic_names_and_the_picker_tokenizes_it_offline() -> None:
    flags = _sidecar_flags()
    model = flags["kv-events-topic"].rsplit("@", 1)[1]
    assert flags["model"] == model, "radixkv's pool is shaped by --model, the model the events name"
    shape = known_model(model)
    assert shape == MODEL_SHAPES["smollm2-360m"] and (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        32,
        5,
        64,
    )
    assert "pool" not in flags, "no hand-written layout to drift from the model"
    producer = epp.plugin(_picker_config(), "token-producer")["parameters"]
    assert producer["modelName"] == model, "the picker tokenizes with the model's own tokenizer"
    render = _container("radixkv-epp", "vllm-render")
    assert render["command"] == ["vllm", "launch", "render"]
    assert f"--served-model-name={model}" in render["args"]
    assert producer["vllm"]["url"] == f"http://localhost:{render['ports'][0]['containerPort']}"
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in render["env"], "never reaches for the Hub"
    files = _container("radixkv-epp", "tokenizer-files")  # the files come from an image, into the pod
    local = render["args"][0]
    assert any(m["mountPath"] == local for m in render["volumeMounts"])
    assert any(m["mountPath"] == local for m in files["volumeMounts"]) and files["command"][-1].startswith(local)
    assert render["image"] == VERSIONS["vllm"]["renderImage"]


def test_the_sidecar_is_native_probed_over_grpc_and_publishes_where_the_picker_dials() -> None:
    pod = _find("Deployment", "llm")["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "radixkv")
    assert sidecar["restartPolicy"] == "Always", "a native sidecar: an init container that keeps running"
    flags = _sidecar_flags()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["grpc"]["port"] == int(flags["port"])
    assert any(
        e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" for e in sidecar["env"]
    )
    discovery = epp.plugin(_picker_config(), "precise-prefix-cache-producer")["parameters"]["kvEventsConfig"]
    assert discovery["discoverPods"] is True
    ports = discovery["podDiscoveryConfig"]
    assert flags["kv-events-endpoint"] == f"tcp://$(POD_IP):{ports['socketPort']}", "bound on the pod's IP"
    assert flags["kv-events-replay-endpoint"] == f"tcp://$(POD_IP):{ports['replaySocketPort']}"
    assert "kv-events-connect" not in flags and "kv-events-bind-all-interfaces" not in flags
    assert {ports["socketPort"], ports["replaySocketPort"]} <= {p["containerPort"] for p in sidecar["ports"]}
    assert re.fullmatch(r"kv@\$\(POD_IP\):\d+@\S+", flags["kv-events-topic"])
    assert flags["kv-events-topic"].startswith(discovery["topicFilter"])
    model_port = int(flags["kv-events-topic"].split(":")[1].split("@")[0])
    assert model_port in {p["containerPort"] for c in pod["containers"] for p in c["ports"]}
    secret = _find("Secret")["metadata"]["name"]
    assert any(v.get("secret", {}).get("secretName") == secret for v in pod["volumes"])
    pool = _find("InferencePool")
    assert pool["spec"]["targetPorts"][0]["number"] == model_port, "the picker's pods are the ones the topic names"
    service = _find("Service", pool["spec"]["endpointPickerRef"]["name"])
    assert service["spec"]["ports"][0]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]
    picker = _container("radixkv-epp", "epp")
    assert f"--pool-name={pool['metadata']['name']}" in picker["args"]
    assert "--config-file=/config/epp-config.yaml" in picker["args"]


def test_no_manifest_hard_codes_a_namespace() -> None:
    for filename, doc in _documents():
        assert "namespace" not in doc["metadata"], f"{filename}: {doc['kind']} applies to the namespace it is put in"
    text = "\n".join(p.read_text() for p in DEPLOY.glob("*.yaml"))
    assert ".svc.cluster.local" not in text and "namespace: default" not in text
    picker = _container("radixkv-epp", "epp")
    namespace = next(e for e in picker["env"] if e["name"] == "NAMESPACE")  # the pool's: the picker's own
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert not any(a.startswith("--pool-namespace") for a in picker["args"])


def test_only_the_picker_reaches_the_events_ports_and_every_other_port_stays_open() -> None:
    policy = _find("NetworkPolicy")["spec"]
    pod = _find("Deployment", "llm")["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    picker_labels = _find("Deployment", "radixkv-epp")["spec"]["template"]["metadata"]["labels"]
    flags = _sidecar_flags()
    events = {int(flags[k].rsplit(":", 1)[1]) for k in ("kv-events-endpoint", "kv-events-replay-endpoint")}
    open_to: dict[int, list[Any]] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            open_to.setdefault(port["port"], []).append(rule.get("from"))
    for port in events:
        sources = open_to[port]
        assert all(s == [{"podSelector": {"matchLabels": picker_labels}}] for s in sources), "the picker alone"
    assert "kv-events-insecure-publish-tenant-prompts" in flags, "the trust boundary accepted by name, and..."
    every = {
        p["containerPort"]
        for c in (*pod["spec"]["initContainers"], *pod["spec"]["containers"])
        for p in c.get("ports", ())
    }
    assert every <= set(open_to), "...enforced by the policy, which leaves the pod's other ports reachable"


def test_the_upstream_versions_are_pinned_in_one_place() -> None:
    assert _container("radixkv-epp", "epp")["image"] == VERSIONS["llm-d-router"]["image"]
    assert VERSIONS["llm-d-router"]["image"].endswith(":" + VERSIONS["llm-d-router"]["version"])
    assert _picker_config()["apiVersion"] == VERSIONS["llm-d-router"]["configApiVersion"]
    assert _find("InferencePool")["apiVersion"] == VERSIONS["gateway-api-inference-extension"]["apiVersion"]
    assert _find("PodMonitor")["apiVersion"] == VERSIONS["prometheus-operator"]["apiVersion"]
    assert VERSIONS["vllm"]["renderImage"].endswith(":v" + VERSIONS["vllm"]["version"])
    titles = {f.name: json.loads(f.read_text())["title"] for f in (DEPLOY / "schemas").glob("*.json")}
    for project, schema in (
        ("gateway-api-inference-extension", "inferencepool-inference.networking.k8s.io-v1.json"),
        ("llm-d-router", "endpointpickerconfig-llm-d.ai-v1alpha1.json"),
        ("prometheus-operator", "podmonitor-monitoring-v1.json"),
    ):
        pinned = VERSIONS[project]
        assert pinned["version"].lstrip("v") in titles[schema] and pinned["commit"] in titles[schema], schema


def test_the_keeper_holds_the_memory_so_the_server_container_can_restart_alone() -> None:
    pod = _find("Deployment", "llm")["spec"]["template"]["spec"]
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
    server_flags = dict(a.removeprefix("--").split("=", 1) for a in server["args"] if a.startswith("--") and "=" in a)
    assert server_flags["keeper"] == f"{state_dir}/keeper.sock"
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_at(container: dict[str, Any], path: str) -> dict[str, Any]:
        return volumes[next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == path)]

    # The same volumes in both: the socket and state, and /dev/shm; both outlive a container, not the pod.
    for path in (state_dir, "/dev/shm"):
        assert volume_at(keeper, path) is volume_at(server, path)
        assert "emptyDir" in volume_at(keeper, path)
    assert volume_at(keeper, "/dev/shm")["emptyDir"]["medium"] == "Memory"
