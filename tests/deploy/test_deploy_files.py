"""deploy/ checked as text: Docker and Kubernetes cannot run here (the topology itself is tested
with processes in test_replicas.py). The YAML parses, the probes ask gRPC health, the configs
the files carry load as kvgate configs, the image runs as a non-root user, the unit is hardened.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _docs(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


# ---- Dockerfile ---------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_non_root_with_a_data_volume_and_a_grpc_healthcheck() -> None:
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines()]
    assert sum(line.startswith("FROM ") for line in lines) >= 2
    assert any(re.match(r"COPY --from=\w+", line) for line in lines)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users, "no USER"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert 'VOLUME ["/var/lib/kvgate"]' in lines
    assert "HF_HOME=/var/lib/kvgate/hf" in text  # the model cache lives on the volume
    healthcheck = text[text.index("HEALTHCHECK"):]
    assert "grpc_health" in healthcheck and "SERVING" in healthcheck
    assert any(line.startswith('ENTRYPOINT ["kvgate", "serve"]') for line in lines)
    # every source directory the package needs is copied into the build stage
    for package in ("gateway", "tiers", "policies"):
        assert f"COPY {package} ./{package}" in lines


# ---- compose ------------------------------------------------------------------------------


def _secret_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    path.chmod(0o400)
    return path


def test_compose_runs_two_replicas_on_one_password_protected_tls_redis(tmp_path: Path) -> None:
    (compose,) = _docs(DEPLOY / "compose.yaml")
    services = compose["services"]
    redis_command = services["redis"]["command"]
    assert "--requirepass" in redis_command
    assert redis_command[redis_command.index("--port") + 1] == "0"  # TLS only
    assert "--tls-port" in redis_command
    replicas = [name for name, svc in services.items() if name.startswith("kvgate")]
    assert len(replicas) == 2
    a, b = (services[name] for name in replicas)
    # YAML merge: B is A with its own volume and port
    for svc in (a, b):
        assert set(svc["environment"]) == {"KVGATE_API_KEYS_FILE", "KVGATE_ADMIN_KEYS_FILE",
                                           "KVGATE_REDIS_URL_FILE"}
        targets = {f"/run/secrets/{secret['target']}": secret for secret in svc["secrets"]}
        for path in svc["environment"].values():
            assert targets[path]["mode"] == 0o400, path  # keys only from secret files
        assert svc["configs"][0]["target"] == "/etc/kvgate/kvgate.toml"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert all(port.startswith("127.0.0.1:") for port in svc["ports"])
    assert a["volumes"] != b["volumes"]
    assert set(compose["volumes"]) == {v.split(":")[0] for v in a["volumes"] + b["volumes"]}

    text = compose["configs"]["kvgate_toml"]["content"]
    assert "key =" not in text and "redis_url" not in text and "PASSWORD" not in text
    url = "rediss://:pw@redis:6380/0?ssl_ca_certs=/run/secrets/redis_ca"
    assert "rediss://:$pw@redis:6380/0?ssl_ca_certs=/run/secrets/redis_ca" in (
        DEPLOY / "compose.yaml").read_text(encoding="utf-8")
    path = tmp_path / "kvgate.toml"
    path.write_text(text, encoding="utf-8")
    config = load_serve_config(path, env={
        "KVGATE_REDIS_URL_FILE": str(_secret_file(tmp_path, "redis-url", url + "\n"))})
    assert config.cache.redis_url == url
    assert not config.cache.redis_cluster and config.cache.remote_write
    assert config.host == "0.0.0.0" and config.allow_insecure_remote
    assert config.admin_port == 50052
    assert config.secret_path == Path("/run/secrets/kvgate_deployment_secret")
    assert config.data_dir == Path("/var/lib/kvgate")


# ---- Kubernetes ---------------------------------------------------------------------------


def test_k8s_manifests_parse_and_have_the_expected_objects() -> None:
    objects = _k8s_objects()
    assert {("Deployment", "kvgate"), ("Service", "kvgate"), ("Service", "kvgate-admin"),
            ("Service", "kvgate-metrics"),
            ("ConfigMap", "kvgate-config"), ("Secret", "kvgate-secrets"),
            ("StatefulSet", "kvgate-redis"), ("Service", "kvgate-redis"),
            ("NetworkPolicy", "kvgate"), ("NetworkPolicy", "kvgate-redis")} <= set(objects)
    secret = objects[("Secret", "kvgate-secrets")]["stringData"]
    assert set(secret) == {"deployment-secret", "api-keys", "admin-keys", "redis-password",
                           "redis-url", "metrics-token"}
    assert secret["redis-url"].startswith("rediss://")
    service = objects[("Service", "kvgate")]
    deployment = objects[("Deployment", "kvgate")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # gRPC and the OpenAI-compatible HTTP API, not the Admin port
    assert [p["port"] for p in service["spec"]["ports"]] == [50051, 8000]
    admin = objects[("Service", "kvgate-admin")]
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["admin"]


def test_k8s_pods_do_not_mount_a_service_account_token() -> None:
    objects = _k8s_objects()
    for kind, name in (("Deployment", "kvgate"), ("StatefulSet", "kvgate-redis")):
        pod = objects[(kind, name)]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name


def test_k8s_deployment_probes_ask_grpc_health_and_runs_non_root() -> None:
    deployment = _k8s_objects()[("Deployment", "kvgate")]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] >= 2
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "http": 8000, "admin": 50052, "metrics": 9464}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["admin"], probe
    assert container["readinessProbe"]["grpc"]["service"] == "kvgate.v1.Gateway"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/var/lib/kvgate" in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["secret"]["secret"]["defaultMode"] == 0o400


def test_k8s_keys_come_only_from_the_secret_as_env_or_files() -> None:
    objects = _k8s_objects()
    deployment = objects[("Deployment", "kvgate")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["KVGATE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "kvgate-secrets",
                                                                    "key": "api-keys"}
    assert env["KVGATE_ADMIN_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "kvgate-secrets",
                                                                      "key": "admin-keys"}
    secret_volume = {v["name"]: v for v in pod["volumes"]}["secret"]["secret"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert secret_volume["secretName"] == "kvgate-secrets"
    paths = {f"{mounts['secret']}/{item['path']}" for item in secret_volume["items"]}
    assert env["KVGATE_REDIS_URL_FILE"]["value"] in paths
    assert env["KVGATE_METRICS_TOKEN_FILE"]["value"] in paths
    template = objects[("ConfigMap", "kvgate-config")]["data"]["kvgate.toml"]
    assert "key =" not in template and "redis_url =" not in template


def test_k8s_health_service_names_are_the_servers() -> None:
    from gateway.service.server import HEALTH_SERVICES

    deployment = _k8s_objects()[("Deployment", "kvgate")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"].get("service", "") in HEALTH_SERVICES


def test_k8s_configmap_and_secret_load_as_a_kvgate_config_with_tls_redis(tmp_path: Path) -> None:
    objects = _k8s_objects()
    template = objects[("ConfigMap", "kvgate-config")]["data"]["kvgate.toml"]
    url = objects[("Secret", "kvgate-secrets")]["stringData"]["redis-url"].replace(
        "REPLACE-redis-password", "pw")
    path = tmp_path / "kvgate.toml"
    path.write_text(template, encoding="utf-8")
    config = load_serve_config(path, env={
        "KVGATE_REDIS_URL_FILE": str(_secret_file(tmp_path, "redis-url", url))})
    assert config.cache.redis_url is not None and config.cache.redis_url.startswith("rediss://")
    assert "kvgate-redis:6380" in config.cache.redis_url
    assert config.port == 50051 and config.host == "0.0.0.0"
    assert config.admin_port == 50052
    deployment = objects[("Deployment", "kvgate")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert config.secret_path.parent == Path(mounts["secret"])
    assert container["args"] == ["--config", mounts["config"] + "/kvgate.toml"]
    ca = url.split("ssl_ca_certs=", 1)[1]
    assert Path(ca).parent == Path(mounts["redis-tls"])


def test_k8s_serves_metrics_where_the_annotations_the_servicemonitor_and_prometheus_look(
        tmp_path: Path) -> None:
    objects = _k8s_objects()
    path = tmp_path / "kvgate.toml"
    path.write_text(objects[("ConfigMap", "kvgate-config")]["data"]["kvgate.toml"],
                    encoding="utf-8")
    # The Deployment gives the Redis tier its URL from the Secret (KVGATE_REDIS_URL_FILE).
    config = load_serve_config(path, env={"KVGATE_REDIS_URL": "rediss://kvgate-redis:6380/0"})
    assert config.metrics.enabled and config.metrics.host == "0.0.0.0"
    assert config.http.metrics  # the API port's /metrics, for routers
    template = objects[("Deployment", "kvgate")]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == config.metrics.port and ports["http"] == config.http.port
    annotations = template["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true",
                           "prometheus.io/port": str(config.metrics.port),
                           "prometheus.io/path": "/metrics"}
    service = objects[("Service", "kvgate-metrics")]
    assert [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("metrics", "metrics")]
    assert service["spec"]["selector"] == template["metadata"]["labels"]
    (monitor,) = _docs(K8S / "monitoring" / "servicemonitor.yaml")
    assert monitor["kind"] == "ServiceMonitor"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "kvgate"
    scrape = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text(
        encoding="utf-8"))
    (job,) = [job for job in scrape["scrape_configs"] if job["job_name"] == "kvgate"]
    assert {target.rsplit(":", 1)[1] for static in job["static_configs"]
            for target in static["targets"]} == {str(config.metrics.port)}
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == (
        scrape["global"]["scrape_interval"], scrape["global"]["scrape_timeout"])


def test_k8s_redis_requires_auth_and_tls() -> None:
    objects = _k8s_objects()
    redis = objects[("StatefulSet", "kvgate-redis")]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    command = " ".join(container["args"])
    assert "--user default off" in command
    assert '"~kvgate:*"' in command and "-@dangerous" in command
    assert "--port 0 --tls-port 6380" in command
    service = objects[("Service", "kvgate-redis")]
    assert [p["port"] for p in service["spec"]["ports"]] == [6380]


def test_k8s_network_policies_let_only_the_apps_reach_kvgate_and_only_kvgate_reach_redis(
) -> None:
    objects = _k8s_objects()
    kvgate = objects[("NetworkPolicy", "kvgate")]["spec"]
    assert kvgate["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvgate"}
    assert set(kvgate["policyTypes"]) == {"Ingress", "Egress"}
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in kvgate["ingress"]}
    assert set(by_port) == {50051, 50052, 9464}
    apps, ops, monitoring = by_port[50051], by_port[50052], by_port[9464]
    ports_of = {rule["ports"][0]["port"]: {p["port"] for p in rule["ports"]}
                for rule in kvgate["ingress"]}
    # gRPC and HTTP; Admin alone; the operators' metrics port alone
    assert ports_of == {50051: {50051, 8000}, 50052: {50052}, 9464: {9464}}
    assert [list(peer) for peer in apps] == [["namespaceSelector"]]
    assert apps != ops and monitoring not in (apps, ops)
    egress_ports = {p["port"] for rule in kvgate["egress"] for p in rule["ports"]}
    assert egress_ports == {6380, 53}
    redis = objects[("NetworkPolicy", "kvgate-redis")]["spec"]
    assert redis["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvgate-redis"}
    ((rule,),) = [redis["ingress"]]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name":
                                                                "kvgate"}}}]
    assert rule["ports"] == [{"port": 6380, "protocol": "TCP"}]
    assert redis["egress"] == []


# ---- systemd ------------------------------------------------------------------------------


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        name, sep, value = line.partition("=")
        assert sep, f"not a directive: {raw!r}"
        current.setdefault(name, []).append(value)
    return sections


@pytest.mark.parametrize(("directive", "value"), [
    ("DynamicUser", "yes"),
    ("StateDirectory", "kvgate"),
    ("StateDirectoryMode", "0700"),
    ("UMask", "0077"),
    ("NoNewPrivileges", "yes"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "yes"),
    ("PrivateTmp", "yes"),
    ("CapabilityBoundingSet", ""),
    ("KillSignal", "SIGTERM"),
])
def test_systemd_unit_is_hardened(directive: str, value: str) -> None:
    service = _unit(DEPLOY / "systemd" / "kvgate.service")["Service"]
    assert service[directive] == [value]


def test_systemd_unit_passes_config_and_secret_as_credentials() -> None:
    unit = _unit(DEPLOY / "systemd" / "kvgate.service")
    service = unit["Service"]
    assert {c.split(":")[0] for c in service["LoadCredential"]} == {"kvgate.toml",
                                                                  "deployment-secret"}
    (exec_start,) = service["ExecStart"]
    assert exec_start.split()[1:3] == ["serve", "--config"]
    assert "${CREDENTIALS_DIRECTORY}/kvgate.toml" in exec_start
    assert "--data-dir ${STATE_DIRECTORY}" in exec_start
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_readme_cites_the_measured_ttft_numbers() -> None:
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    top = (DEPLOY.parent / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for device, redis in (("290.9", "703.7"), ("346.8", "1,108.6")):
        assert device in readme and redis in readme
        assert re.search(rf"warm: device\s+{re.escape(device)}", top)
        assert re.search(rf"warm: redis\s+{re.escape(redis)}", top)
    for word in ("ACL", "rediss://", "requirepass", "deployment secret", "NetworkPolicy"):
        assert word in readme or word in (DEPLOY / "compose.yaml").read_text(encoding="utf-8")


# ---- Prometheus alert rules -----------------------------------------------------------------


def test_the_shadow_divergence_alert_fires_on_the_metric_the_gateway_exports() -> None:
    from gateway.service.metrics import GatewayMetrics

    [doc] = _docs(DEPLOY / "observability" / "alerts.yaml")
    rules = {r["alert"]: r for group in doc["groups"] for r in group["rules"]}
    rule = rules["KvgateShadowDivergence"]
    assert "kvgate_shadow_divergences_total" in rule["expr"]
    assert rule["labels"]["severity"] == "critical"
    metrics = GatewayMetrics()
    metrics.record_shadow_check(num_blocks=3, divergent_tiers=["device"])
    assert metrics.registry.get_sample_value(
        "kvgate_shadow_divergences_total", {"tier": "device"}) == 1.0


def test_k8s_and_prometheus_send_the_metrics_scrape_token_kvgate_reads(tmp_path: Path) -> None:
    """The scrape token (issue 44, LOW): kvgate reads it from the Secret's metrics-token, the
    ServiceMonitor sends that key, and prometheus.yml's jobs send a token file."""
    objects = _k8s_objects()
    (container,) = objects[("Deployment", "kvgate")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVGATE_METRICS_TOKEN_FILE"] == "/etc/kvgate/secret/metrics-token"
    (monitor,) = _docs(K8S / "monitoring" / "servicemonitor.yaml")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": "kvgate-secrets", "key": "metrics-token"}}
    placeholder = objects[("Secret", "kvgate-secrets")]["stringData"]["metrics-token"]
    with pytest.raises(ConfigError, match="metrics scrape token"):
        load_serve_config(None, env={"KVGATE_METRICS_TOKEN_FILE": str(
            _secret_file(tmp_path, "metrics-token", placeholder))})
    scrape = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text(
        encoding="utf-8"))
    for job in scrape["scrape_configs"]:
        assert job["authorization"]["type"] == "Bearer", job["job_name"]
        assert job["authorization"]["credentials_file"], job["job_name"]
