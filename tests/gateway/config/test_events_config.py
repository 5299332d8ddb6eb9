"""``[events]``: the KV-events publisher is off unless named, and never reachable from other
machines unless the operator says so (the events carry prompt token ids)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.events import EventsSettings
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError
from gateway.service.kv_events.publisher import open_kv_events


def load(tmp_path: Path, events_toml: str) -> EventsSettings:
    path = tmp_path / "kvgate.toml"
    path.write_text("[events]\n" + events_toml, encoding="utf-8")
    return load_serve_config(path, env={}).events


def refusal(tmp_path: Path, events_toml: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, events_toml)
    return str(caught.value)


def test_events_are_off_by_default() -> None:
    events = load_serve_config(None, env={}).events
    assert not events.is_enabled
    assert open_kv_events(events) is None


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://localhost:5557",
                                      "tcp://[::1]:5557", "ipc:///run/kvgate/kv-events"])
def test_loopback_and_unix_socket_endpoints_are_accepted(tmp_path: Path, endpoint: str) -> None:
    events = load(tmp_path, f'kv_events_endpoint = "{endpoint}"\n'
                            'kv_events_replay_endpoint = "tcp://127.0.0.1:5558"\n'
                            'kv_events_topic = "kv@pod-1@model"\nkv_events_buffer = 100\n')
    assert events == EventsSettings(kv_events_endpoint=endpoint,
                                    kv_events_replay_endpoint="tcp://127.0.0.1:5558",
                                    kv_events_topic="kv@pod-1@model", kv_events_buffer=100)
    assert events.is_enabled


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557"])
def test_a_non_loopback_endpoint_is_refused_with_the_reason(tmp_path: Path,
                                                            endpoint: str) -> None:
    message = refusal(tmp_path, f'kv_events_endpoint = "{endpoint}"\n')
    assert f"events.kv_events_endpoint: '{endpoint}' binds" in message
    assert "token ids" in message and "allow_remote = true" in message


def test_a_non_loopback_replay_endpoint_is_refused_too(tmp_path: Path) -> None:
    message = refusal(tmp_path, 'kv_events_endpoint = "tcp://127.0.0.1:5557"\n'
                                'kv_events_replay_endpoint = "tcp://*:5558"\n')
    assert "events.kv_events_replay_endpoint: 'tcp://*:5558' binds" in message


def test_allow_remote_lets_a_routable_endpoint_bind(tmp_path: Path) -> None:
    events = load(tmp_path, 'kv_events_endpoint = "tcp://*:5557"\nallow_remote = true\n')
    assert events.kv_events_endpoint == "tcp://*:5557" and events.allow_remote


def test_every_events_problem_is_listed_at_once(tmp_path: Path) -> None:
    message = refusal(tmp_path, 'kv_events_endpoint = "inproc://kv"\n'
                                'kv_events_replay_endpoint = "tcp://127.0.0.1:0"\n'
                                'kv_events_buffer = 0\nallow_remote = "yes"\nhwm = 5\n')
    for expected in (
        "[events] has unknown keys ['hwm']",
        "events.kv_events_endpoint: 'inproc://kv' is not tcp://HOST:PORT or ipc://PATH",
        "events.kv_events_replay_endpoint: 'tcp://127.0.0.1:0' needs a port from 1 to 65535",
        "events.kv_events_buffer must be an integer from 1",
        "events.allow_remote must be true or false, got 'yes'",
    ):
        assert expected in message


def test_a_replay_endpoint_needs_the_events_and_an_address_of_its_own(tmp_path: Path) -> None:
    assert "needs kv_events_endpoint" in refusal(
        tmp_path, 'kv_events_replay_endpoint = "tcp://127.0.0.1:5558"\n')
    assert "must differ from kv_events_endpoint" in refusal(
        tmp_path, 'kv_events_endpoint = "tcp://127.0.0.1:5557"\n'
                  'kv_events_replay_endpoint = "tcp://127.0.0.1:5557"\n')


def test_the_configured_publisher_binds_where_it_is_told(tmp_path_factory: pytest.TempPathFactory
                                                         ) -> None:
    where = tmp_path_factory.mktemp("ev")
    publisher = open_kv_events(EventsSettings(kv_events_endpoint=f"ipc://{where}/pub",
                                              kv_events_replay_endpoint=f"ipc://{where}/replay"))
    assert publisher is not None
    try:
        assert (publisher.endpoint, publisher.replay_endpoint) == (
            f"ipc://{where}/pub", f"ipc://{where}/replay")
        assert (where / "pub").exists() and (where / "replay").exists()
    finally:
        publisher.close()
