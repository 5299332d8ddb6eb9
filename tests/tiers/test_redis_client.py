"""redis-py wiring of the Redis tier that needs no server (``tiers.redis_client``): passwords
never survive redaction, and key prefixes match literally in SCAN."""

from __future__ import annotations

import pytest

from tiers.redis_client import build_client, glob_escape, redact_url, url_secrets


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://kvgate:s3cr%40t@host:6380/1", "rediss://kvgate:***@host:6380/1"),
        ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=%2A%2A%2A&db=1"),
    ],
)
def test_a_redacted_url_holds_no_password(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


def test_the_secrets_of_a_url_come_raw_and_encoded_longest_first() -> None:
    assert url_secrets("redis://u:p@ss@host:1/0?password=other") == ("p%40ss", "other", "p@ss")
    assert url_secrets("redis://host:1/0") == ()


def test_glob_specials_are_escaped() -> None:
    assert glob_escape("kv*gate?[x]\\") == "kv\\*gate\\?\\[x\\]\\\\"


def test_a_bad_url_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        build_client("http://nowhere", cluster=False, socket_timeout_s=0.1,
                     connect_timeout_s=0.1)
