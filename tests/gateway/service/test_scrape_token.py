"""The metrics scrape token (issue 44, LOW): with ``[metrics] scrape_token_file`` set, both
``/metrics`` -- the API port's and ``[metrics]``' own -- answer only ``Authorization: Bearer
<token>``; anything else is a 401 that says what to send.

One real ``kvgate serve`` (tiny Llama) started by the module with the token in a 0600 file, and
stopped by pid. Before the token existed, both answered every scrape: on a quiet replica the
API port's series gave another tenant's prompt size and cache hit.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiny_llama import save_tiny_llama

KVGATE = str(Path(sys.executable).parent / "kvgate")
TOKEN = "kvg-scrape-Vq7Lm2Xe9Rb4Tn6Wc1Hs8Jd3"
API_KEY = "kvg-scrape-tenant-Pz5Ga8Ku3Yf0Nr7Bx2Me4"
_SERVING = re.compile(r"SERVING kvgate\.v1 on 127\.0\.0\.1:(\d+)")
_HTTP = re.compile(r"OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1")
_METRICS = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")


class Served:
    def __init__(self, http_port: int, metrics_port: int) -> None:
        self.http_port = http_port
        self.metrics_port = metrics_port


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("scrape")
    model = save_tiny_llama(root / "model")
    token_file = root / "metrics-token"
    token_file.write_text(TOKEN + "\n", encoding="ascii")
    token_file.chmod(0o600)
    config = root / "kvgate.toml"
    config.write_text(f"""
[grpc]
shutdown_grace_s = 1

[http]
port = 0

[cache]
block_tokens = 16
device_bytes = "16MiB"
host_bytes = 0
disk_bytes = 0

[metrics]
enabled = true
port = 0
scrape_token_file = "{token_file}"
""", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_API_KEYS"] = f"{API_KEY}=tenant-a"
    err_path = root / "serve.err"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [KVGATE, "serve", "--config", str(config), "--port", "0", "--data-dir",
             str(root / "data"), "--model", str(model)],
            stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        deadline = time.monotonic() + 90.0
        while not _SERVING.search(err_path.read_text(errors="replace")):
            assert proc.poll() is None, err_path.read_text(errors="replace")
            assert time.monotonic() < deadline, err_path.read_text(errors="replace")
            time.sleep(0.05)
        log = err_path.read_text(errors="replace")
        http_match, metrics_match = _HTTP.search(log), _METRICS.search(log)
        assert http_match and metrics_match, log
        yield Served(int(http_match.group(1)), int(metrics_match.group(1)))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def scrape(port: int, authorization: str | None) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    try:
        headers = {} if authorization is None else {"Authorization": authorization}
        conn.request("GET", "/metrics", headers=headers)
        response = conn.getresponse()
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                response.read().decode())
    finally:
        conn.close()


@pytest.mark.parametrize("which", ["http_port", "metrics_port"])
def test_a_scrape_without_the_token_is_401_saying_what_to_send(served: Served,
                                                              which: str) -> None:
    status, headers, body = scrape(getattr(served, which), None)
    assert status == 401
    assert headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer <token>" in body and "scrape_token_file" in body
    assert "kvgate_" not in body


@pytest.mark.parametrize("which", ["http_port", "metrics_port"])
@pytest.mark.parametrize("authorization", [
    f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, f"Bearer {API_KEY}", "Bearer "])
def test_a_scrape_with_another_token_or_scheme_is_401(served: Served, which: str,
                                                      authorization: str) -> None:
    status, _, body = scrape(getattr(served, which), authorization)
    assert status == 401
    assert "kvgate_" not in body


@pytest.mark.parametrize("which", ["http_port", "metrics_port"])
def test_a_scrape_with_the_token_gets_the_series(served: Served, which: str) -> None:
    status, _, body = scrape(getattr(served, which), f"Bearer {TOKEN}")
    assert status == 200
    assert "kvgate_requests_total" in body
