"""What the client commands share (``gateway.cli.common``): which key a command sends, and the
plain-text output helpers. No gateway is needed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.cli.common import (
    UsageError,
    add_connection_args,
    admin_key_of,
    api_key_of,
    first_words,
    format_bytes,
    render_table,
)

DEV_KEY = "kvg-dev-" + "x" * 32


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    (tmp_path / "dev-api-key").write_text(DEV_KEY + "\n", encoding="ascii")
    return tmp_path


def test_the_flag_wins_then_the_environment_then_the_dev_key(data_dir: Path) -> None:
    env = {"KVGATE_API_KEY": "from-env"}
    assert api_key_of("from-flag", env, host="127.0.0.1", data_dir=data_dir) == "from-flag"
    assert api_key_of(None, env, host="127.0.0.1", data_dir=data_dir) == "from-env"
    assert api_key_of(None, {}, host="127.0.0.1", data_dir=data_dir) == DEV_KEY


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_the_dev_key_is_read_for_a_gateway_on_loopback(data_dir: Path, host: str) -> None:
    assert api_key_of(None, {}, host=host, data_dir=data_dir) == DEV_KEY


def test_the_dev_key_never_travels_to_another_machine(data_dir: Path) -> None:
    assert api_key_of(None, {}, host="10.0.0.7", data_dir=data_dir) is None
    assert api_key_of(None, {}, host="gateway.internal", data_dir=data_dir) is None


def test_no_data_dir_or_no_dev_key_means_no_key(data_dir: Path, tmp_path: Path) -> None:
    assert api_key_of(None, {}, host="127.0.0.1", data_dir=None) is None
    assert api_key_of(None, {}, host="127.0.0.1", data_dir=tmp_path / "empty") is None


def connection_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    return parser.parse_args(argv)


def test_the_admin_key_comes_from_the_flag_the_environment_or_the_config(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text('[[admin_keys]]\nkey_blake2b = "00"\n\n'
                      '[[admin_keys]]\nname = "ops"\nkey = "from-config"\n')
    env = {"KVGATE_ADMIN_KEY": "from-env"}
    assert admin_key_of(connection_args("--admin-key", "a"), env, required=True) == "a"
    assert admin_key_of(connection_args("--config", str(config)), env,
                        required=True) == "from-env"
    assert admin_key_of(connection_args("--config", str(config)), {},
                        required=True) == "from-config"
    assert admin_key_of(connection_args(), {}, required=False) is None


def test_a_missing_admin_key_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no admin key"):
        admin_key_of(connection_args(), {}, required=True)
    digests_only = tmp_path / "kvgate.toml"
    digests_only.write_text('[[admin_keys]]\nkey_blake2b = "00"\n')
    with pytest.raises(UsageError, match="digests cannot be sent"):
        admin_key_of(connection_args("--config", str(digests_only)), {}, required=False)
    with pytest.raises(UsageError, match="cannot read the configuration"):
        admin_key_of(connection_args("--config", str(tmp_path / "absent.toml")), {},
                     required=False)


def test_tables_pad_columns_to_their_widest_cell() -> None:
    assert render_table(["tier", "blocks"], [["device", "3"], ["disk", "1200"]]) == (
        "tier    blocks\n"
        "------  ------\n"
        "device  3\n"
        "disk    1200\n"
    )


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 << 20, "3.0 MiB"),
     (5 << 40, "5120.0 GiB")],
)
def test_bytes_in_binary_units(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


def test_first_words_fit_the_limit_on_one_line() -> None:
    assert first_words("a  short\nprompt") == "a short prompt"
    assert first_words("word " * 20, 20) == "word word word wo..."
