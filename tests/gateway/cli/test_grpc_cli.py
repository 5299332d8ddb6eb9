"""``kvgate serve`` and ``kvgate generate`` as an operator runs them: real processes, real signals.

``gateway_proc`` is a harness piece (docs/reliability.md, "Harness"): the real ``kvgate serve`` as a
subprocess (tiny Llama, 16-token blocks, device + host + disk tiers under its data dir), listening
on a port it picks itself (``--port 0``; the port is read from its SERVING log line), health polled
until SERVING, stopped by pid with SIGTERM. Tests that only send requests share one such process
(``serving``); tests that restart or signal it start their own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import KvgateClient
from gateway.core.requests import TokenDelta, Usage
from tests.gateway.grpc_harness import LONG_PROMPT
from tests.tiny_llama import save_tiny_llama

KVGATE = str(Path(sys.executable).parent / "kvgate")
GRACE_S = 5.0
STREAM_TOKENS = 200
"""Decoded by the stream that SIGTERM finds in flight: long enough to be still streaming when
the signal lands, short enough to finish well within GRACE_S on a loaded 2-core machine."""
_SERVING = re.compile(r"SERVING kvgate\.v1 on 127\.0\.0\.1:(\d+)")
_ADDRESSES = re.compile(r"gRPC kvgate\.v1 on 127\.0\.0\.1:(\d+); OpenAI-compatible HTTP on "
                        r"(http://127\.0\.0\.1:\d+/v1)")

CONFIG = f"""
[grpc]
shutdown_grace_s = {GRACE_S}

[http]
port = 0

[cache]
block_tokens = 16
device_bytes = "64MiB"
host_bytes = "64MiB"
disk_bytes = "64MiB"
# What a tier serves, not whether it is worth loading: the tiny Llama recomputes a
# block about as fast as it loads, so the load-or-recompute judgement is a coin toss.
skip_slow_tiers = false
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


class GatewayProcess:
    """One ``kvgate serve`` process at a time on ``data_dir`` (restartable)."""

    def __init__(self, root: Path, model_dir: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.env = env or {}  # beside the environment, less its KVGATE_ variables
        self.data_dir = root / "data"
        self.model_dir = model_dir
        self.config = root / "kvgate.toml"
        self.config.write_text(CONFIG, encoding="utf-8")
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._runs = 0

    @property
    def stdout(self) -> str:
        return (self.root / f"serve-{self._runs}.out").read_text(encoding="utf-8")

    @property
    def stderr(self) -> str:
        return (self.root / f"serve-{self._runs}.err").read_text(encoding="utf-8")

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        self._runs += 1
        with (self.root / f"serve-{self._runs}.out").open("wb") as out, \
                (self.root / f"serve-{self._runs}.err").open("wb") as err:
            self.proc = subprocess.Popen(
                [KVGATE, "serve", "--config", str(self.config), "--port", "0",
                 "--data-dir", str(self.data_dir), "--model", str(self.model_dir)],
                stdout=out, stderr=err, env={**_clean_env(), **self.env},
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kvgate serve exited:\n{self.stderr}"
            match = _SERVING.search(self.stderr)
            if match:
                self.port = int(match.group(1))
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"kvgate serve did not start:\n{self.stderr}")
        assert self.health() == health_pb2.HealthCheckResponse.SERVING
        return self

    def health(self) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status: int = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            return status

    def generate(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KVGATE, "generate", "--port", str(self.port), "--data-dir", str(self.data_dir),
             *args],
            capture_output=True, text=True, timeout=60, env=_clean_env(), check=False,
        )

    def sigterm(self) -> tuple[int, float]:
        """SIGTERM by pid; the exit status and the seconds it took to exit."""
        assert self.proc is not None
        began = time.monotonic()
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=GRACE_S + 10)
        finally:
            self.kill()
        return code, time.monotonic() - began

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def gateway_proc(tmp_path: Path, model_dir: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess(tmp_path, model_dir)
    try:
        yield process
    finally:
        process.kill()


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory, model_dir: Path
            ) -> Iterator[GatewayProcess]:
    """One started ``kvgate serve`` for the tests that only send it requests; SIGTERM at the
    end must stop it with status 0."""
    process = GatewayProcess(tmp_path_factory.mktemp("serving"), model_dir)
    try:
        yield process.start()
        code, _ = process.sigterm()
        assert code == 0, process.stderr
    finally:
        process.kill()


def _usage_fields(stderr: str) -> dict[str, str]:
    lines = [line for line in stderr.splitlines() if "cached_tokens=" in line]
    assert len(lines) == 1, stderr
    return dict(part.split("=", 1) for part in lines[0].split())


def test_serve_then_generate_twice_shows_the_cache_and_survives_a_restart(
    gateway_proc: GatewayProcess,
) -> None:
    gateway_proc.start()
    # the start line says where and in what the model computes: auto is float32 on the CPU
    started = re.search(r"model \S+ on (\S+) in (\w+),", gateway_proc.stderr)
    assert started is not None, gateway_proc.stderr
    device, dtype = started.groups()
    assert dtype == ("bfloat16" if device.startswith("cuda") else "float32")
    key_file = gateway_proc.data_dir / "dev-api-key"
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((gateway_proc.data_dir / "secret").stat().st_mode) == 0o600
    # stdout is a pipe here, not a terminal: it names the key's file, never the key
    assert str(key_file) in gateway_proc.stdout and "default" in gateway_proc.stdout
    assert key not in gateway_proc.stdout and key not in gateway_proc.stderr

    first = gateway_proc.generate("--max-tokens", "8", LONG_PROMPT)
    assert first.returncode == 0, first.stderr
    assert first.stdout and "cached_tokens" not in first.stdout  # only the text
    cold = _usage_fields(first.stderr)
    assert cold["cached_tokens"] == "0" and cold["completion_tokens"] == "8"
    assert "ttft_ms" in cold and "cached_by_tier" in cold

    second = gateway_proc.generate("--max-tokens", "8", LONG_PROMPT)
    assert second.returncode == 0, second.stderr
    warm = _usage_fields(second.stderr)
    assert int(warm["cached_tokens"]) > 0
    assert "device:" in warm["cached_by_tier"]
    assert second.stdout == first.stdout  # greedy: warm equals cold

    code, _ = gateway_proc.sigterm()
    assert code == 0, gateway_proc.stderr

    gateway_proc.start()  # same data dir: same key, same secret, disk blocks served again
    assert key_file.read_text().strip() == key
    third = gateway_proc.generate("--max-tokens", "8", LONG_PROMPT)
    assert third.returncode == 0, third.stderr
    restarted = _usage_fields(third.stderr)
    assert int(restarted["cached_tokens"]) > 0 and "disk:" in restarted["cached_by_tier"]
    assert third.stdout == first.stdout

    # The admin commands work out of the box: the dev admin key lies beside the dev key.
    admin_key_file = gateway_proc.data_dir / "dev-admin-key"
    assert stat.S_IMODE(admin_key_file.stat().st_mode) == 0o600
    assert str(admin_key_file) in gateway_proc.stdout
    assert admin_key_file.read_text().strip() not in gateway_proc.stdout

    def admin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KVGATE, "admin", *args, "--port", str(gateway_proc.port), "--data-dir",
             str(gateway_proc.data_dir)],
            capture_output=True, text=True, timeout=60, env=_clean_env(), check=False)

    listed = admin("ls")
    assert listed.returncode == 0, listed.stderr
    key = listed.stdout.splitlines()[2].split()[0]
    num_blocks = int(listed.stdout.splitlines()[2].split()[2])
    evicted = admin("evict", "--key", key, "--yes")
    assert evicted.returncode == 0, evicted.stderr
    assert evicted.stdout.startswith(f"freed {num_blocks} blocks\n")
    again = admin("evict", "--key", key, "--yes")
    assert again.returncode == 3 and "nothing changed" in again.stderr
    fourth = gateway_proc.generate("--max-tokens", "8", LONG_PROMPT)
    assert fourth.returncode == 0, fourth.stderr
    assert _usage_fields(fourth.stderr)["cached_tokens"] == "0"


def test_generate_reports_errors_on_stderr_with_a_failing_status(
    serving: GatewayProcess, tmp_path: Path,
) -> None:
    wrong = serving.generate("--api-key", "not-the-key-0123456789abcdef", "hello")
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert "UNAUTHENTICATED" in wrong.stderr
    bad = serving.generate("--max-tokens", "0", "hello")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr
    messages = tmp_path / "chat.json"
    messages.write_text('[{"role": "system", "content": "Be brief."}]', encoding="utf-8")
    chat = serving.generate("--messages", str(messages), "--max-tokens", "3", "Hi")
    assert chat.returncode == 0, chat.stderr
    assert _usage_fields(chat.stderr)["completion_tokens"] == "3"
    urgent = serving.generate("--priority", "-5", "--max-tokens", "2", "Hi")
    assert urgent.returncode == 0, urgent.stderr
    beyond = serving.generate("--priority", "5000", "hello")
    assert beyond.returncode == 1 and "priority must be an integer from" in beyond.stderr
    assert serving.generate().returncode == 2  # no prompt: a usage error


def test_generate_allow_lossy_without_a_lossy_tier_prints_the_exact_answer_and_line(
    serving: GatewayProcess,
) -> None:
    exact = serving.generate("--max-tokens", "4", LONG_PROMPT)
    allowed = serving.generate("--allow-lossy", "--max-tokens", "4", LONG_PROMPT)
    assert exact.returncode == 0 and allowed.returncode == 0, allowed.stderr
    assert allowed.stdout == exact.stdout
    fields = _usage_fields(allowed.stderr)
    assert list(fields) == list(_usage_fields(exact.stderr)) and "lossy" not in fields
    assert int(fields["cached_tokens"]) > 0


def test_sigterm_finishes_the_stream_in_flight_and_exits_0_within_the_grace_period(
    gateway_proc: GatewayProcess,
) -> None:
    gateway_proc.start()
    key = (gateway_proc.data_dir / "dev-api-key").read_text().strip()
    received: list[TokenDelta | Usage] = []
    failures: list[BaseException] = []
    started = threading.Event()

    def stream() -> None:
        try:
            with KvgateClient("127.0.0.1", gateway_proc.port, key) as client:
                for item in client.generate(LONG_PROMPT, max_tokens=STREAM_TOKENS):
                    received.append(item)
                    started.set()
        except BaseException as exc:  # reported below
            failures.append(exc)
            started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    assert not any(isinstance(item, Usage) for item in received)  # still streaming ...
    code, seconds = gateway_proc.sigterm()  # ... when SIGTERM is sent
    thread.join(timeout=30)
    assert code == 0, gateway_proc.stderr
    assert seconds < GRACE_S + 2.0
    assert not failures
    assert isinstance(received[-1], Usage) and received[-1].completion_tokens == STREAM_TOKENS
    assert "shutting down" in gateway_proc.stderr and "stopped" in gateway_proc.stderr


def test_serve_starts_the_openai_front_beside_grpc_and_prints_both_addresses(
    serving: GatewayProcess,
) -> None:
    match = _ADDRESSES.search(serving.stdout)
    assert match, serving.stdout
    assert int(match.group(1)) == serving.port
    url = match.group(2)
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as response:
        assert json.loads(response.read())["status"] == "ok"
    key = (serving.data_dir / "dev-api-key").read_text().strip()
    with openai.OpenAI(base_url=url, api_key=key, max_retries=0) as client:
        completion: Any = client.chat.completions.create(
            model=serving.model_dir.name, max_tokens=3,
            messages=[{"role": "user", "content": LONG_PROMPT}])
    assert completion.usage.completion_tokens == 3
    # SIGTERM stops it, HTTP front and all, with status 0: checked where ``serving`` ends.


def test_kvgate_explain_names_a_message_id_the_http_front_kept(serving: GatewayProcess) -> None:
    """``kvgate serve`` gives both fronts one ``PromptComparisons``: an id made over HTTP is
    explained over gRPC."""
    match = _ADDRESSES.search(serving.stdout)
    assert match, serving.stdout
    key = (serving.data_dir / "dev-api-key").read_text().strip()
    ask = {"role": "user", "content": "Which refunds are paid back to the card?"}
    claude: Any = anthropic.Anthropic(base_url=match.group(2).removesuffix("/v1"), api_key=key,
                                      max_retries=0)
    with claude:
        message = claude.messages.create(
            model=serving.model_dir.name, max_tokens=2, system=LONG_PROMPT, messages=[ask],
            diagnostics={"previous_message_id": None})
    explained = subprocess.run(
        [KVGATE, "explain", "--previous", message.id, "--port", str(serving.port),
         "--data-dir", str(serving.data_dir), ask["content"]],
        capture_output=True, text=True, timeout=60, env=_clean_env(), check=False)
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout.splitlines()[0] == (
        f"compared with {message.id}: the system messages (instructions) changed")


def test_serve_refuses_a_plaintext_remote_listener(tmp_path: Path, model_dir: Path) -> None:
    env = {**_clean_env(), "KVGATE_API_KEYS": "tenant-a-key-Rw4Tx9Lq2Zm7Kc5V=tenant-a"}
    result = subprocess.run(
        [KVGATE, "serve", "--host", "0.0.0.0", "--port", "0", "--data-dir",
         str(tmp_path / "data"), "--model", str(model_dir)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )
    assert result.returncode == 1
    assert "without TLS" in result.stderr and "--allow-insecure-remote" in result.stderr


def test_serve_refuses_keyless_development_mode_off_loopback(tmp_path: Path,
                                                              model_dir: Path) -> None:
    result = subprocess.run(
        [KVGATE, "serve", "--host", "0.0.0.0", "--port", "0", "--allow-insecure-remote",
         "--data-dir", str(tmp_path / "data"), "--model", str(model_dir)],
        capture_output=True, text=True, timeout=60, env=_clean_env(), check=False,
    )
    assert result.returncode == 1
    assert "loopback only" in result.stderr
    assert not (tmp_path / "data" / "dev-api-key").exists()


def test_serve_reports_a_bad_configuration_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[limits]\nmax_calls = 0\n", encoding="utf-8")
    result = subprocess.run([KVGATE, "serve", "--config", str(config)], capture_output=True,
                            text=True, timeout=60, env=_clean_env(), check=False)
    assert result.returncode == 2
    assert "limits.max_calls must be an integer >= 1" in result.stderr
