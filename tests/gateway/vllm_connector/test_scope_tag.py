"""A scope signed by the gateway reaches the connector; nothing a caller of vLLM sets does
(gateway/vllm_connector/scope_tag.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.fingerprint import Scope
from gateway.vllm_connector.scope_tag import (
    EXPIRES_PARAM,
    SCOPE_PARAM,
    TAG_PARAM,
    parse_default_scope,
    parse_scope,
    scope_key,
    scope_text,
    sign,
    verify,
)

SECRET = b"s" * 32
KEY = scope_key(SECRET)
NOW = 1_780_000_000_000
LATER = NOW + 60_000

tenants = st.text(min_size=1, max_size=40)
scopes = st.one_of(st.just(Scope.shared()), tenants.map(Scope.of_tenant))


@given(scope=scopes)
def test_a_signed_scope_verifies_to_itself(scope: Scope) -> None:
    check = verify(sign(scope, KEY, expires_at_ms=LATER), KEY, now_ms=NOW)
    assert check.scope == scope and check.refusal is None


@given(scope=scopes)
def test_a_scope_reads_back_from_its_text(scope: Scope) -> None:
    assert parse_scope(scope_text(scope)) == scope


def test_another_deployments_tag_is_refused() -> None:
    params = sign(Scope.of_tenant("a"), scope_key(b"t" * 32), expires_at_ms=LATER)
    assert verify(params, KEY, now_ms=NOW).refusal == "tag"


@pytest.mark.parametrize("field, value", [(SCOPE_PARAM, "tenant:b"), (SCOPE_PARAM, "shared"),
                                          (EXPIRES_PARAM, str(LATER + 1))])
def test_a_changed_field_is_refused(field: str, value: str) -> None:
    params = sign(Scope.of_tenant("a"), KEY, expires_at_ms=LATER)
    params[field] = value
    assert verify(params, KEY, now_ms=NOW).refusal == "tag"


def test_an_expired_tag_is_refused() -> None:
    params = sign(Scope.of_tenant("a"), KEY, expires_at_ms=NOW)
    assert verify(params, KEY, now_ms=NOW).refusal == "expired"


def test_parameters_without_a_scope_are_missing_not_refused_as_forged() -> None:
    assert verify(None, KEY, now_ms=NOW).refusal == "missing"
    assert verify({"other": 1}, KEY, now_ms=NOW).refusal == "missing"


@pytest.mark.parametrize("params", [
    {SCOPE_PARAM: "tenant:a"},
    {SCOPE_PARAM: "tenant:a", EXPIRES_PARAM: str(LATER), TAG_PARAM: "not hex"},
    {SCOPE_PARAM: "tenant:a", EXPIRES_PARAM: "-5", TAG_PARAM: "00" * 32},
    {SCOPE_PARAM: "tenant:", EXPIRES_PARAM: str(LATER), TAG_PARAM: "00" * 32},
    {SCOPE_PARAM: 7, EXPIRES_PARAM: str(LATER), TAG_PARAM: "00" * 32},
])
def test_malformed_parameters_are_refused(params: dict[str, object]) -> None:
    check = verify(params, KEY, now_ms=NOW)
    assert check.scope is None and check.refusal == "malformed"


def test_the_default_scope_none_neither_loads_nor_stores() -> None:
    assert parse_default_scope("none") is None
    assert parse_default_scope("shared") == Scope.shared()
    assert parse_default_scope("tenant:acme") == Scope.of_tenant("acme")


def test_a_default_scope_naming_nothing_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="'none', 'shared' or 'tenant:<id>'"):
        parse_default_scope("everyone")


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="16 to 64 bytes"):
        scope_key(b"short")
