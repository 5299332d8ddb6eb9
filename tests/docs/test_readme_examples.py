"""The README's first calls, run as written against a live gateway, so that they cannot go stale.

One real ``kvgate serve`` for the module (the tiny Llama, saved in a directory named ``bundled``
so that the OpenAI example's ``model="bundled"`` names it; default block size; both fronts on
free loopback ports), stopped by pid with SIGTERM at the end. The examples are read from the
README's code blocks and changed only where a live test must: the ports, the data directory
that holds the development key, and the answer's length (``ANSWER_TOKENS``: the tiny model's
answers mean nothing, and a short one keeps the test quick on a busy machine). Outputs differ
from the README's (another model); what is checked is that each example runs and that its
second run is served from the cache with the same answer.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from gateway.service.pb import kvgate_pb2 as pb
from tests.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
KVGATE = str(Path(sys.executable).parent / "kvgate")
README_GRPC_PORT = "50051"
README_HTTP_PORT = "8000"
README_KEY_FILE = "data/dev-api-key"
README_MAX_TOKENS = "48"
ANSWER_TOKENS = "4"

_SERVING = re.compile(r"SERVING kvgate\.v1 on 127\.0\.0\.1:(\d+)")
_ADDRESSES = re.compile(r"OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1")
_CODE_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def code_blocks(language: str) -> list[str]:
    return [body for lang, body in _CODE_BLOCK.findall(README.read_text(encoding="utf-8"))
            if lang == language]


def readme_block(language: str, marker: str) -> str:
    (block,) = [body for body in code_blocks(language) if marker in body]
    return block


def shell_commands(block: str) -> list[list[str]]:
    """The ``$ ...`` commands of a transcript (continuation lines joined), as argv lists."""
    commands, current = [], ""
    for line in block.splitlines():
        if current:
            current += " " + line.strip()
        elif line.startswith("$ ") and not line.startswith("$ #"):
            current = line[2:]
        if current and not current.endswith("\\"):
            commands.append(shlex.split(current))
            current = ""
        elif current:
            current = current[:-1]
    return commands


@dataclass
class Gateway:
    data_dir: Path
    grpc_port: int
    http_port: int

    @property
    def api_key(self) -> str:
        return (self.data_dir / "dev-api-key").read_text(encoding="utf-8").strip()

    def localise(self, source: str) -> str:
        """A README example pointed at this gateway instead of `make serve`'s."""
        for old, new in ((README_KEY_FILE, str(self.data_dir / "dev-api-key")),
                         (f"127.0.0.1:{README_HTTP_PORT}", f"127.0.0.1:{self.http_port}"),
                         (f'"127.0.0.1", {README_GRPC_PORT}', f'"127.0.0.1", {self.grpc_port}'),
                         (f"max_tokens={README_MAX_TOKENS}", f"max_tokens={ANSWER_TOKENS}"),
                         (f"max_output_tokens={README_MAX_TOKENS}",
                          f"max_output_tokens={ANSWER_TOKENS}")):
            is_responses = "responses.create" in source
            if old.startswith("max_tokens=") and is_responses:
                continue  # the Responses API names it max_output_tokens
            if old.startswith("max_output_tokens=") and not is_responses:
                continue
            if old.startswith("127.0.0.1:") and not any(
                    client in source for client in ("OpenAI(", "Anthropic(")):
                continue
            if old.startswith('"127.0.0.1"') and "KvgateClient(" not in source:
                continue
            assert old in source, f"the README example lost {old!r}"
            source = source.replace(old, new)
        return source


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("readme")
    model_dir = save_tiny_llama(root / "bundled")
    config = root / "kvgate.toml"
    config.write_text("[http]\nport = 0\n", encoding="utf-8")
    data_dir = root / "data"
    out_path, err_path = root / "serve.out", root / "serve.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            [KVGATE, "serve", "--config", str(config), "--port", "0", "--data-dir",
             str(data_dir), "--model", str(model_dir)],
            stdout=out, stderr=err, env=_clean_env())
    try:
        deadline = time.monotonic() + 120
        while not _SERVING.search(err_path.read_text(encoding="utf-8")):
            assert proc.poll() is None, err_path.read_text(encoding="utf-8")
            assert time.monotonic() < deadline, err_path.read_text(encoding="utf-8")
            time.sleep(0.05)
        grpc_match = _SERVING.search(err_path.read_text(encoding="utf-8"))
        http_match = _ADDRESSES.search(out_path.read_text(encoding="utf-8"))
        assert grpc_match and http_match, out_path.read_text(encoding="utf-8")
        yield Gateway(data_dir, int(grpc_match.group(1)), int(http_match.group(1)))
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, err_path.read_text(encoding="utf-8")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _usage(stderr: str) -> dict[str, str]:
    (line,) = [line for line in stderr.splitlines() if "cached_tokens=" in line]
    return dict(part.split("=", 1) for part in line.split())


def test_the_kvgate_generate_transcript_runs_and_its_second_run_is_cached(
    gateway: Gateway,
) -> None:
    block = readme_block("sh", "kvgate generate")
    commands = shell_commands(block)
    assert len(commands) == 3, commands
    assert all(c == commands[0] for c in (c[:-1] if c[-1] == ">/dev/null" else c
                                          for c in commands[1:])), commands
    argv = commands[0]
    assert argv[:2] == [".venv/bin/kvgate", "generate"], argv
    assert argv[argv.index("--max-tokens") + 1] == README_MAX_TOKENS
    run = [KVGATE, *argv[1:], "--port", str(gateway.grpc_port), "--data-dir",
           str(gateway.data_dir), "--max-tokens", ANSWER_TOKENS]
    first, second = (subprocess.run(run, capture_output=True, text=True, timeout=120,
                                    cwd=ROOT, env=_clean_env(), check=False) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    assert first.stdout and first.stdout == second.stdout  # warm equals cold
    cold, warm = _usage(first.stderr), _usage(second.stderr)
    assert cold["cached_tokens"] == "0" and cold["cached_by_tier"] == "-"
    assert int(warm["cached_tokens"]) > 0
    assert warm["cached_by_tier"] == f"device:{warm['cached_tokens']}"
    # The README's usage lines have the fields, in the order, that the CLI prints.
    shown = [line for line in block.splitlines() if line.startswith("prompt_tokens=")]
    assert len(shown) == 3
    for line in shown:
        assert [p.split("=")[0] for p in line.split()] == list(cold)


def run_twice(source: str) -> list[str]:
    """Run a Python example twice in a fresh interpreter, from the repository root (the
    examples name deploy/examples/... relative to it); the second run's printed lines."""
    separator = "----- second run -----"
    program = f"{source}\nprint({separator!r})\n{source}"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env=_clean_env(), check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.split(separator + "\n", 1)[1].splitlines()


def test_the_python_client_example_runs_and_its_second_run_is_cached(gateway: Gateway) -> None:
    printed = run_twice(gateway.localise(readme_block("python", "from gateway.client import")))
    match = re.fullmatch(r"(\d+) \{'device': (\d+)\}", printed[0])
    assert match and int(match.group(1)) > 0 and match.group(1) == match.group(2), printed
    assert printed[1].startswith("LookupResult("), printed


def test_the_openai_sdk_example_runs_and_its_second_run_is_cached(gateway: Gateway) -> None:
    printed = run_twice(gateway.localise(readme_block("python", "from openai import OpenAI")))
    assert int(printed[0]) > 0, printed
    kvgate = printed[1]
    assert kvgate.startswith("{'cached_tokens_by_tier': {'device': "), printed
    assert "'ttft_ms': " in kvgate, printed


def test_the_responses_example_runs_and_its_second_turn_is_cached(gateway: Gateway) -> None:
    printed = run_twice(gateway.localise(readme_block("python", "responses.create")))
    prompt, cached = (int(number) for number in printed[0].split())
    assert 0 < cached < prompt, printed


def test_the_anthropic_sdk_example_runs_and_its_second_run_is_cached(gateway: Gateway) -> None:
    printed = run_twice(gateway.localise(readme_block("python", "from anthropic import")))
    read, created = (int(number) for number in printed[0].split())
    assert read > 0 and created == 0, printed
    kvgate = printed[1]
    assert kvgate.startswith(f"{{'cached_tokens_by_tier': {{'device': {read}}}"), printed
    assert "'cache_creation_ttl_s': 3600.0" in kvgate, printed


def test_the_grpcurl_request_matches_the_proto_and_is_served(gateway: Gateway) -> None:
    """grpcurl itself is not installed here: its JSON body is parsed against the proto (unknown
    fields fail) and sent, as grpcurl would, to the method it names."""
    block = readme_block("sh", "grpcurl")
    body = re.search(r"-d '(.*?)'", block, re.S)
    method = re.search(r"kvgate\.v1\.(\w+)/(\w+)", block)
    assert body and method, block
    request = json_format.Parse(body.group(1), pb.GenerateRequest())
    assert request.sampling.max_tokens > 0 and request.input.messages
    request.sampling.max_tokens = int(ANSWER_TOKENS)
    service, rpc = method.groups()
    assert pb.DESCRIPTOR.services_by_name[service].methods_by_name[rpc].server_streaming
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        call = channel.unary_stream(
            f"/kvgate.v1.{service}/{rpc}",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString)
        replies = list(call(request, metadata=(("authorization", f"Bearer {gateway.api_key}"),),
                            timeout=180))
    assert replies[-1].HasField("usage")
    assert 0 < replies[-1].usage.completion_tokens <= request.sampling.max_tokens
    assert json.loads(json_format.MessageToJson(replies[-1]))["usage"]["promptTokens"]
