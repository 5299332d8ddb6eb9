"""``[http] served_model_name`` / ``kvgate serve --served-model-name`` (issue 26, item 5): one id
or a list of aliases, from the file or the command line, validated with the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import build_parser
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError
from gateway.service.http.app import served_model_names


def test_the_default_serves_the_model_directory_name_and_the_model_value() -> None:
    config = load_serve_config(None, env={})
    assert config.http.served_model_name == ()
    assert served_model_names("/models/llama-3-8b") == ("llama-3-8b", "/models/llama-3-8b")
    assert served_model_names("bundled") == ("bundled",)


def test_a_file_gives_one_id_or_a_list_of_aliases(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[http]\nserved_model_name = "my-model"\n', encoding="utf-8")
    assert load_serve_config(path, env={}).http.served_model_name == ("my-model",)
    path.write_text('[http]\nserved_model_name = ["my-model", "alias"]\n', encoding="utf-8")
    names = load_serve_config(path, env={}).http.served_model_name
    assert names == ("my-model", "alias")
    assert served_model_names("/models/x", names) == ("my-model", "alias")


def test_the_command_line_overrides_the_file(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    path = tmp_path / "kvgate.toml"
    path.write_text('[http]\nserved_model_name = "from-file"\n', encoding="utf-8")
    config = load_serve_config(path, env={},
                               overrides={"served_model_name": args.served_model_name})
    assert config.http.served_model_name == ("a", "b")


@pytest.mark.parametrize("value", ['""', '["a", "a"]', "3", '[" padded"]'])
def test_an_empty_repeated_or_non_string_name_is_refused(tmp_path: Path, value: str) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(f"[http]\nserved_model_name = {value}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="http.served_model_name"):
        load_serve_config(path, env={})
