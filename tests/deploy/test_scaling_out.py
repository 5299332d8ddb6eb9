"""The scaling-out examples (deploy/compose.smg.yaml, deploy/k8s/smg/, deploy/k8s/inference-pool/;
docs/scaling-out.md) checked as text: they parse, name kvgate's real services, ports, health
path and metric names, and keep keys out of the files. SMG itself against kvgate processes:
tests/cluster/test_smg_cache_aware.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gateway.service.router_metrics import CacheConfigInfo, RouterCounts, VllmCollector

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
HTTP_PORT = 8000
_VLLM = re.compile(r"vllm:[a-z_]+")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _served_vllm_names() -> set[str]:
    """Every ``vllm:`` sample name kvgate's ``/metrics`` carries (from the collector itself)."""
    collector = VllmCollector(
        model_name="model",
        counts=lambda: RouterCounts(num_waiting=0, num_running=0, num_prompt_tokens=0,
                                    num_cached_tokens=0, kv_usage=0.0),
        info=CacheConfigInfo(block_size=64, num_gpu_blocks=1, num_cpu_blocks=0,
                             cache_dtype="float32"))
    return {sample.name for family in collector.collect() for sample in family.samples}


def test_compose_smg_runs_three_replicas_behind_smg_cache_aware() -> None:
    (compose,) = _docs(DEPLOY / "compose.smg.yaml")
    services = compose["services"]
    replicas = sorted(name for name in services if name.startswith("kvgate"))
    assert len(replicas) == 3
    for name in replicas:
        svc = services[name]
        assert "ports" not in svc, name  # reached through smg only
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["configs"][0]["target"] == "/etc/kvgate/kvgate.toml"
    assert len({services[name]["volumes"][0] for name in replicas}) == 3
    command = services["smg"]["command"][0]
    assert "--policy cache_aware" in command and "--health-check-endpoint /health" in command
    urls = re.findall(r"http://([\w-]+):(\d+)", command)
    assert sorted(host for host, _ in urls) == replicas
    assert {int(port) for _, port in urls} == {HTTP_PORT}
    assert "[http]" in compose["configs"]["kvgate_toml"]["content"]
    assert f"port = {HTTP_PORT}" in compose["configs"]["kvgate_toml"]["content"]
    assert all(p.startswith("127.0.0.1:") for p in services["smg"]["ports"])
    assert "$$(cat /run/secrets/smg_router_key)" in command  # keys from secret files


def test_k8s_smg_discovers_kvgate_pods_on_the_http_port() -> None:
    objects = {(d["kind"], d["metadata"]["name"]): d for d in _docs(DEPLOY / "k8s/smg/smg.yaml")}
    kvgate = {(d["kind"], d["metadata"]["name"]): d for d in _docs(DEPLOY / "k8s/deployment.yaml")}
    pod_labels = kvgate[("Deployment", "kvgate")]["spec"]["template"]["metadata"]["labels"]
    kvgate_ports = {p["containerPort"] for c in kvgate[("Deployment", "kvgate")]["spec"][
        "template"]["spec"]["containers"] for p in c["ports"]}
    (container,) = objects[("Deployment", "kvgate-smg")]["spec"]["template"]["spec"]["containers"]
    args = container["args"][0]
    selector = re.search(r"--selector (\S+)", args)
    assert selector is not None
    key, value = selector.group(1).split("=")
    assert pod_labels[key] == value
    port = re.search(r"--service-discovery-port (\d+)", args)
    assert port is not None and int(port.group(1)) == HTTP_PORT and HTTP_PORT in kvgate_ports
    assert "--policy cache_aware" in args
    role = objects[("Role", "kvgate-smg-discovery")]["rules"][0]
    assert role["resources"] == ["pods"] and set(role["verbs"]) == {"get", "list", "watch"}
    secret = objects[("Secret", "kvgate-smg")]["stringData"]
    assert all(value.startswith("REPLACE-") for value in secret.values())


def test_inference_pool_selects_kvgate_and_names_only_metrics_kvgate_serves() -> None:
    path = DEPLOY / "k8s/inference-pool/inferencepool.yaml"
    objects = {(d["kind"], d["metadata"]["name"]): d for d in _docs(path)}
    kvgate = {(d["kind"], d["metadata"]["name"]): d for d in _docs(DEPLOY / "k8s/deployment.yaml")}
    pod_labels = kvgate[("Deployment", "kvgate")]["spec"]["template"]["metadata"]["labels"]
    pool = objects[("InferencePool", "kvgate")]["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [HTTP_PORT]
    assert pool["endpointPickerRef"]["name"] in {name for _, name in objects}
    named = set(_VLLM.findall(path.read_text(encoding="utf-8")))
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= named
    assert named <= _served_vllm_names(), named - _served_vllm_names()
    config = yaml.safe_load(objects[("ConfigMap", "kvgate-epp")]["data"]["epp-config.yaml"])
    refs = {ref["pluginRef"] for profile in config["schedulingProfiles"]
            for ref in profile["plugins"]}
    assert refs == {plugin["type"] for plugin in config["plugins"]}
