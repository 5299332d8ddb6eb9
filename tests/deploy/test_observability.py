"""deploy/observability/ checked by the tools that will read it, and against a live gateway.

``promtool`` (Debian's ``prometheus`` package; ``make promtool`` installs it) checks the scrape
config and the alert rules, runs the rules' unit tests (``alerts_test.yaml``: each alert fires on
the series that should raise it, once per replica) and parses every dashboard expression. Without
promtool these skip, except under ``KVGATE_REQUIRE_PROMTOOL=1`` (``make test`` sets it): then they
fail. The last tests start a real ``kvgate serve`` (tiny Llama, Redis, ``[metrics]`` on), send one
request and check that every metric the rules and the dashboard name is in its ``/metrics``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.cli.test_grpc_cli import CONFIG, GatewayProcess
from tests.gateway.grpc_harness import LONG_PROMPT
from tests.redis_harness import RedisServer
from tests.tiny_llama import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
ALERTS = OBSERVABILITY / "alerts.yaml"
SCRAPE_CONFIG = OBSERVABILITY / "prometheus.yml"
DASHBOARD = OBSERVABILITY / "grafana-kvgate.json"
ALERT_TESTS = Path(__file__).with_name("alerts_test.yaml")
REQUIRE_PROMTOOL_ENV = "KVGATE_REQUIRE_PROMTOOL"

SYNTHETIC = frozenset({"up"})
"""Series Prometheus makes itself for every target, never in a target's /metrics."""
_METRIC_NAME = re.compile(r"\b(?:kvgate_\w+|process_\w+|up)\b")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_METRICS_LINE = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")
_HTTP_LINE = re.compile(r"OpenAI-compatible HTTP on (http://127\.0\.0\.1:\d+)/v1")
_GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


# ---- promtool -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = ("promtool not found on PATH: install Debian's prometheus "
                  "(`sudo apt-get install -y --no-install-recommends prometheus`, or "
                  "`make promtool`)")
        if os.environ.get(REQUIRE_PROMTOOL_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_PROMTOOL_ENV} is set: {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(arg) for arg in args], capture_output=True, text=True,
                          timeout=60, check=False, cwd=ROOT)


def test_promtool_checks_the_alert_rules(promtool: str) -> None:
    done = _run(promtool, "check", "rules", ALERTS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_checks_the_scrape_config_and_the_rules_it_loads(promtool: str,
                                                                  tmp_path: Path) -> None:
    # promtool checks that the scrape token's credentials_file exists: a copy beside one.
    for name in (SCRAPE_CONFIG, ALERTS):
        shutil.copy(name, tmp_path / Path(name).name)
    (tmp_path / "kvgate-metrics-token").write_text("token\n", encoding="utf-8")
    done = _run(promtool, "check", "config", tmp_path / Path(SCRAPE_CONFIG).name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout


def test_each_alert_fires_on_its_series_once_per_replica(promtool: str) -> None:
    done = _run(promtool, "test", "rules", ALERT_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_dashboard_expression_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Each query, with Grafana's variables filled in, checked as a recording rule."""
    rules = [{"record": f"kvgate:dashboard_{i}", "expr": _fill(expr)}
             for i, expr in enumerate(_dashboard_queries())]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}),
                    encoding="utf-8")
    done = _run(promtool, "check", "rules", path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_without_promtool_make_test_fails_instead_of_skipping() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    test_target = re.search(r"^test:(.*)\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert test_target is not None
    assert "promtool" in test_target.group(1).split()
    assert f"{REQUIRE_PROMTOOL_ENV}=1" in test_target.group(2)
    env = {**os.environ, REQUIRE_PROMTOOL_ENV: "1", "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).relative_to(ROOT)}::test_promtool_checks_the_alert_rules"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "KVGATE_REQUIRE_PROMTOOL is set: promtool not found on PATH" in done.stdout


# ---- what the files say -------------------------------------------------------------------


def _alert_rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return {rule["alert"]: rule for group in doc["groups"] for rule in group["rules"]}


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [target["expr"] for panel in dashboard["panels"]
               for target in panel.get("targets", ())]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"]
                if variable["type"] == "query"]
    return queries


def _fill(expr: str) -> str:
    """A dashboard query as PromQL: Grafana's interval variables as durations, label_values()
    as the selector it reads, the other template variables as regexes matching anything."""
    for variable, value in _GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    match = re.fullmatch(r"label_values\((.+), *\w+\)", expr)
    if match:
        expr = match.group(1)
    return re.sub(r"\$\w+", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label values and strings left out)."""
    return set(_METRIC_NAME.findall(_STRING.sub('""', expr)))


def test_metric_names_are_read_from_expressions_not_from_their_strings() -> None:
    expr = ('histogram_quantile(0.99, sum by (instance, le) (rate(kvgate_ttft_seconds_bucket'
            '{job=~"kvgate_x|up"}[5m]))) / ignoring (tier) group_left max(up) '
            '+ kvgate_eviction_reader_up')
    assert metric_names(expr) == {"kvgate_ttft_seconds_bucket", "up",
                                  "kvgate_eviction_reader_up"}


def test_every_alert_the_operators_need_is_there_with_a_runbook() -> None:
    rules = _alert_rules()
    wanted = {"KvgateHitRatioCollapse", "KvgateQueueBacklog", "KvgateTtftP99High",
              "KvgateRedisBreakerOpen", "KvgateShadowDivergence", "KvgateVerificationFailure",
              "KvgateLoadFailures", "KvgateKvBudgetNearlyFull", "KvgateTierOverBudget",
              "KvgateReplicaDown", "KvgateEvictionReaderDown"}
    assert set(rules) == wanted
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        for annotation in ("summary", "description", "runbook"):
            assert rule["annotations"].get(annotation, "").strip(), (name, annotation)


def test_the_scrape_config_reads_both_the_metrics_port_and_the_api_port() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    assert config["rule_files"] == ["alerts.yaml"]
    ports = {job["job_name"]: {target.rsplit(":", 1)[1] for static in job["static_configs"]
                               for target in static["targets"]}
             for job in config["scrape_configs"]}
    assert ports == {"kvgate": {"9464"}, "kvgate-api": {"8000"}}  # [metrics] and [http] ports


# ---- against a live gateway ---------------------------------------------------------------


def served_names(exposition: str) -> set[str]:
    """Every series name the exposition serves or declares: a labelled family with no child
    yet (no divergence so far) still names its series in its TYPE line."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count")}
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode("utf-8")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory,
         module_redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    """``kvgate serve`` with Redis (breaker and eviction-feed series) and ``[metrics]`` on,
    after one request; yields the expositions of its metrics port and of its API port."""
    root = tmp_path_factory.mktemp("observability")
    process = GatewayProcess(root, save_tiny_llama(root / "model"))
    process.config.write_text(
        CONFIG + f'redis_url = "{module_redis_server.url}"\n\n'
        '[metrics]\nenabled = true\nhost = "127.0.0.1"\nport = 0\n', encoding="utf-8")
    try:
        process.start()
        metrics_port = _METRICS_LINE.search(process.stderr)
        http_url = _HTTP_LINE.search(process.stdout) or _HTTP_LINE.search(process.stderr)
        assert metrics_port and http_url, process.stderr
        result = process.generate("--max-tokens", "3", "--raw", LONG_PROMPT)
        assert result.returncode == 0, result.stderr
        full = _scrape(f"http://127.0.0.1:{metrics_port.group(1)}/metrics")
        try:
            public = _scrape(f"{http_url.group(1)}/metrics")
        except OSError as exc:  # urllib's HTTPError (404) is an OSError
            public = f"# GET /metrics on the API port: {exc}\n"
        yield full, public
    finally:
        process.kill()


def _named(queries: list[str]) -> set[str]:
    return {name for expr in queries for name in metric_names(expr)} - SYNTHETIC


def test_every_metric_in_the_rules_and_the_dashboard_is_served(live: tuple[str, str]) -> None:
    full, _ = live
    named = _named([rule["expr"] for rule in _alert_rules().values()] + _dashboard_queries())
    assert len(named) > 20
    missing = sorted(named - served_names(full))
    assert not missing, f"named in deploy/observability but not served: {missing}"


def test_every_metric_the_alerts_read_is_served_on_the_api_port_too(
    live: tuple[str, str],
) -> None:
    """The rules hold whichever port Prometheus scrapes (prometheus.yml's two jobs)."""
    _, public = live
    named = _named([rule["expr"] for rule in _alert_rules().values()])
    missing = sorted(named - served_names(public))
    assert not missing, (f"alerts read series the API port's /metrics lacks: {missing}\n"
                         f"{public[:300]}")
