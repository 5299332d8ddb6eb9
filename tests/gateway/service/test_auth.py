"""API keys → principals: parsing, hashing, bearer metadata, and nothing secret in messages."""

from __future__ import annotations

import logging

import pytest

from gateway.config.keys import (
    KeyEntry,
    Principal,
    key_digest,
    parse_key_list,
    tenant_id_problem,
    tenants_without_keys,
)
from gateway.core.addresses import is_loopback
from gateway.core.errors import PermissionDenied, Unauthenticated
from gateway.service.auth import Authenticator

KEY_A = "key-of-tenant-a-Gp5Wc8Lv2Hs7Dk"
KEY_B = "key-of-tenant-b-Jt6Nd3Rx9Ky4Mw"
ADMIN = "key-of-the-admin-Bf2Ym8Qw5Zn1Cx"


@pytest.fixture
def auth() -> Authenticator:
    return Authenticator([
        KeyEntry.of_key(KEY_A, "tenant-a"),
        KeyEntry.of_key(KEY_B, "tenant-b"),
        KeyEntry.of_key(ADMIN, "ops", is_admin=True),
    ])


def bearer(key: str) -> list[tuple[str, str]]:
    return [("user-agent", "test"), ("authorization", f"Bearer {key}")]


def test_a_key_authenticates_as_its_tenant(auth: Authenticator) -> None:
    assert auth.authenticate(bearer(KEY_A)) == Principal(tenant="tenant-a")
    assert auth.authenticate(bearer(KEY_B)) == Principal(tenant="tenant-b")
    assert auth.authenticate(bearer(ADMIN)) == Principal(tenant="ops", is_admin=True)
    assert auth.tenants == {"tenant-a", "tenant-b"}


def test_the_scheme_is_case_insensitive_and_bytes_values_work(auth: Authenticator) -> None:
    assert auth.authenticate([("authorization", f"bearer {KEY_A}")]).tenant == "tenant-a"
    assert auth.authenticate([("Authorization", f"BEARER  {KEY_A} ".encode())]).tenant == \
        "tenant-a"


@pytest.mark.parametrize(
    ("metadata", "hint"),
    [
        (None, "no API key"),
        ([], "no API key"),
        ([("x-api-key", KEY_A)], "no API key"),
        ([("authorization", KEY_A)], "Bearer <key>"),
        ([("authorization", f"Basic {KEY_A}")], "Bearer <key>"),
        ([("authorization", "Bearer ")], "Bearer <key>"),
        ([("authorization", f"Bearer {KEY_A}x")], "not valid"),
        ([("authorization", f"Bearer {KEY_A}"), ("authorization", f"Bearer {KEY_B}")],
         "one `authorization`"),
    ],
)
def test_missing_malformed_and_unknown_keys_are_unauthenticated(
    auth: Authenticator, metadata: list[tuple[str, str]] | None, hint: str
) -> None:
    with pytest.raises(Unauthenticated) as excinfo:
        auth.authenticate(metadata)
    assert hint in str(excinfo.value)
    assert KEY_A not in str(excinfo.value) and KEY_B not in str(excinfo.value)


def test_http_callers_are_told_of_headers_grpc_callers_of_metadata(
    auth: Authenticator,
) -> None:
    for metadata in ([], [("authorization", KEY_A)]):
        with pytest.raises(Unauthenticated) as over_grpc:
            auth.authenticate(metadata)
        with pytest.raises(Unauthenticated) as over_http:
            auth.authenticate(metadata, is_http=True)
        assert "metadata" in str(over_grpc.value)
        assert "header" in str(over_http.value) and "metadata" not in str(over_http.value)


def test_admin_only_operations_name_the_tenant_but_not_the_key(auth: Authenticator) -> None:
    principal = auth.authenticate(bearer(KEY_A))
    with pytest.raises(PermissionDenied, match="admin key.*tenant-a"):
        principal.require_admin("the Admin service")
    auth.authenticate(bearer(ADMIN)).require_admin("the Admin service")


def test_the_table_holds_digests_only(auth: Authenticator) -> None:
    entry = KeyEntry.of_key(KEY_A, "tenant-a")
    assert entry.digest == key_digest(KEY_A) and len(entry.digest) == 32
    assert KEY_A not in repr(entry) and key_digest(KEY_A).hex() not in repr(entry)
    assert KeyEntry.of_digest(key_digest(KEY_A).hex(), "tenant-a") == entry
    assert key_digest(KEY_A) != key_digest(KEY_B)


def test_a_key_given_by_digest_authenticates() -> None:
    auth = Authenticator([KeyEntry.of_digest(key_digest(KEY_A).hex(), "tenant-a")])
    assert auth.authenticate(bearer(KEY_A)).tenant == "tenant-a"
    with pytest.raises(ValueError, match="not hex"):
        KeyEntry.of_digest("zz", "tenant-a")


def test_the_same_key_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        Authenticator([KeyEntry.of_key(KEY_A, "tenant-a"),
                       KeyEntry.of_key(KEY_A, "ops", is_admin=True)])


def test_short_and_unprintable_keys_are_refused_without_echoing_them() -> None:
    for key in ("short", "has a space in it 0123", "tab\tseparated-key-0123",
                "ünïcödé-key-0123456"):
        with pytest.raises(ValueError) as excinfo:
            KeyEntry.of_key(key, "tenant-a")
        assert key not in str(excinfo.value)


@pytest.mark.parametrize("tenant", ["", "shared", " padded", "line\nbreak", "x" * 129])
def test_tenant_ids_that_could_confuse_scopes_are_refused(tenant: str) -> None:
    assert tenant_id_problem(tenant) is not None
    with pytest.raises(ValueError):
        KeyEntry.of_key(KEY_A, tenant)


def test_parse_key_list_reads_the_environment_form() -> None:
    entries = parse_key_list(f" {KEY_A}=tenant-a, {KEY_B}=tenant-b ,", is_admin=False,
                             source="KVGATE_API_KEYS")
    assert [e.principal for e in entries] == [Principal(tenant="tenant-a"),
                                              Principal(tenant="tenant-b")]
    assert entries[0].digest == key_digest(KEY_A)
    admins = parse_key_list(f"{ADMIN},{KEY_A}=ops", is_admin=True, source="KVGATE_ADMIN_KEYS")
    assert [e.principal for e in admins] == [Principal(tenant="admin", is_admin=True),
                                             Principal(tenant="ops", is_admin=True)]
    padded = parse_key_list("key-with-padding-0123456==tenant-c", is_admin=False, source="env")
    assert padded[0].digest == key_digest("key-with-padding-0123456=")


@pytest.mark.parametrize(
    ("text", "hint"),
    [(KEY_A, "no tenant"), (f"{KEY_A}=", "must not be empty"), ("short=tenant-a", "characters"),
     (f"{KEY_A}=shared", "reserved")],
)
def test_parse_key_list_errors_name_the_entry_not_the_key(text: str, hint: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_key_list(text, is_admin=False, source="KVGATE_API_KEYS")
    assert hint in str(excinfo.value) and "entry 1" in str(excinfo.value)
    assert KEY_A not in str(excinfo.value)


def test_authentication_logs_nothing_secret(
    auth: Authenticator, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        auth.authenticate(bearer(KEY_A))
        with pytest.raises(Unauthenticated):
            auth.authenticate(bearer(KEY_B + "0"))
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


def test_loopback_hosts() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""):
        assert not is_loopback(host)


def test_tenants_without_keys_are_reported() -> None:
    entries = [KeyEntry.of_key(KEY_A, "tenant-a")]
    assert tenants_without_keys(entries, ["tenant-a", "tenant-z"]) == ["tenant-z"]
