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
from gateway.config.settings import ServeConfig

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


def _load_toml(text: str, tmp_path: Path) -> ServeConfig:
    path = tmp_path / "kvgate.toml"
    path.write_text(text, encoding="utf-8")
    return load_serve_config(path, env={})


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


def test_compose_runs_two_replicas_on_one_password_protected_redis(tmp_path: Path) -> None:
    (compose,) = _docs(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert "--requirepass" in services["redis"]["command"]
    replicas = [name for name, svc in services.items() if name.startswith("kvgate")]
    assert len(replicas) == 2
    a, b = (services[name] for name in replicas)
    # YAML merge: B is A with its own volume and port
    for svc in (a, b):
        assert svc["env_file"] == "kvgate.env"
        assert svc["secrets"][0]["source"] == "deployment_secret"
        assert svc["configs"][0]["target"] == "/etc/kvgate/kvgate.toml"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert a["volumes"] != b["volumes"]
    assert set(compose["volumes"]) == {v.split(":")[0] for v in a["volumes"] + b["volumes"]}

    text = compose["configs"]["kvgate_toml"]["content"].replace("${REDIS_PASSWORD}", "pw")
    config = _load_toml(text, tmp_path)
    assert config.cache.redis_url == "redis://:pw@redis:6379/0"
    assert not config.cache.redis_cluster and config.cache.remote_write
    assert config.host == "0.0.0.0" and config.allow_insecure_remote
    assert config.secret_path == Path("/run/secrets/kvgate_deployment_secret")
    assert config.data_dir == Path("/var/lib/kvgate")


# ---- Kubernetes ---------------------------------------------------------------------------


def test_k8s_manifests_parse_and_have_the_expected_objects() -> None:
    objects = _k8s_objects()
    assert {("Deployment", "kvgate"), ("Service", "kvgate"), ("ConfigMap", "kvgate-config"),
            ("Secret", "kvgate-secrets"), ("StatefulSet", "kvgate-redis"),
            ("Service", "kvgate-redis")} <= set(objects)
    secret = objects[("Secret", "kvgate-secrets")]["stringData"]
    assert set(secret) == {"deployment-secret", "api-keys", "admin-keys", "redis-password"}
    service = objects[("Service", "kvgate")]
    deployment = objects[("Deployment", "kvgate")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_k8s_deployment_probes_ask_grpc_health_and_runs_non_root() -> None:
    deployment = _k8s_objects()[("Deployment", "kvgate")]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] >= 2
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    port = container["ports"][0]["containerPort"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    assert container["readinessProbe"]["grpc"]["service"] == "kvgate.v1.Gateway"
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["KVGATE_API_KEYS"] == {"name": "kvgate-secrets", "key": "api-keys"}
    assert env["KVGATE_ADMIN_KEYS"] == {"name": "kvgate-secrets", "key": "admin-keys"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/var/lib/kvgate" in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["deployment-secret"]["secret"]["defaultMode"] == 0o400


def test_k8s_health_service_names_are_the_servers() -> None:
    from gateway.service.server import HEALTH_SERVICES

    deployment = _k8s_objects()[("Deployment", "kvgate")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"].get("service", "") in HEALTH_SERVICES


def test_k8s_configmap_renders_to_a_valid_kvgate_config(tmp_path: Path) -> None:
    objects = _k8s_objects()
    template = objects[("ConfigMap", "kvgate-config")]["data"]["kvgate.toml"]
    assert "__REDIS_PASSWORD__" in template
    config = _load_toml(template.replace("__REDIS_PASSWORD__", "pw"), tmp_path)
    assert config.cache.redis_url == "redis://kvgate:pw@kvgate-redis:6379/0"
    assert config.port == 50051 and config.host == "0.0.0.0"
    deployment = objects[("Deployment", "kvgate")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert config.secret_path.parent == Path(mounts["deployment-secret"])
    assert container["args"] == ["--config", mounts["config"] + "/kvgate.toml"]


def test_k8s_redis_requires_auth() -> None:
    redis = _k8s_objects()[("StatefulSet", "kvgate-redis")]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    command = " ".join(container["args"])
    assert "--user default off" in command
    assert '"~kvgate:*"' in command and "-@dangerous" in command


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
    top = (DEPLOY.parent / "README.md").read_text(encoding="utf-8")
    for device, redis in (("129.6", "172.7"), ("183.2", "269.5")):
        assert device in readme and redis in readme
        assert re.search(rf"warm: device\s+{re.escape(device)}", top)
        assert re.search(rf"warm: redis\s+{re.escape(redis)}", top)
    for word in ("ACL", "rediss://", "requirepass", "deployment secret"):
        assert word in readme or word in (DEPLOY / "compose.yaml").read_text(encoding="utf-8")
