"""API keys as configured: digests, whom each authenticates, and the checks on keys and tenant ids.

A key maps to a ``Principal``: a tenant id, and whether it is an admin key. The tenant is the
cache scope of everything the caller sends (docs/design.md, "Identity of a prefix"). Keys are never
kept in the clear: entries hold BLAKE2b digests, and a configuration may hold digests instead of
keys (``key_digest(key).hex()``), so the file itself need not be secret. The service's
``Authenticator`` (``gateway.service.auth``) matches presented keys against these entries.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.core.errors import PermissionDenied

KEY_DIGEST_BYTES = 32
MIN_KEY_CHARS = 16
"""Shorter keys are refused by the configuration: they could be guessed."""

MAX_KEY_CHARS = 512
MIN_DISTINCT_KEY_CHARS = 10
"""A random key of 16 URL-safe characters has ~15 distinct ones; fewer than this is a pattern."""

PLACEHOLDER_WORDS = ("replace", "changeme", "change-me", "change_me", "placeholder",
                     "example", "your-key", "your_key", "xxxxxxxx", "<", ">")
"""Words of placeholders left from examples (the deploy files use ``REPLACE-...``)."""
MIN_KEY_BITS = 80
"""Refused below this estimate (``key_guess_bits``); a random 16-character URL-safe key has ~95."""

GUESSABLE_WORDS = (
    "password", "passwd", "passw0rd", "secret", "admin", "administrator", "root", "guest",
    "user", "login", "access", "letmein", "welcome", "master", "default", "token", "apikey",
    "api", "key", "keys", "kvgate", "kvg", "gateway", "tenant", "replica", "client", "server",
    "service", "test", "testing", "demo", "dev", "prod", "production", "staging", "local",
    "localhost", "bench", "hello", "world", "qwerty", "qwertz", "azerty", "asdf", "zxcv",
    "monkey", "dragon", "shadow", "sunshine", "iloveyou", "football", "baseball", "princess",
    "alpha", "beta", "gamma", "delta", "company", "acme", "team", "openai", "llm",
)
"""Words a person makes a key of; a key that is mostly these (and digits) is refused."""
_WORDS_LONGEST_FIRST = tuple(sorted(set(GUESSABLE_WORDS), key=len, reverse=True))
_CHAR_CLASSES: tuple[tuple[Callable[[str], bool], int], ...] = (
    (str.islower, 26), (str.isupper, 26), (str.isdigit, 10),
    (lambda c: not c.isalnum(), 32),
)
MAX_TENANT_CHARS = 128
RESERVED_TENANTS = frozenset({"shared"})
"""Tenant ids that would be confused with the shared scope (its owner is called "shared")."""

DEFAULT_ADMIN_NAME = "admin"
"""The name of an admin key configured without one (``KVGATE_ADMIN_KEYS=key``)."""

_PERSON = b"kvgate-api-key"


def key_digest(key: str) -> bytes:
    """The digest kept for ``key`` (BLAKE2b-256, personalised for API keys)."""
    return hashlib.blake2b(
        key.encode("utf-8"), digest_size=KEY_DIGEST_BYTES, person=_PERSON
    ).digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """The authenticated caller.

    Attributes:
        tenant: the tenant id: the cache scope of the caller's prompts (an admin key's name is
            its tenant id when it sends prompts in the tenant scope).
        is_admin: an admin key (Admin service, shared scope, pinning).
    """

    tenant: str
    is_admin: bool = False

    def require_admin(self, what: str) -> None:
        """Raise ``PermissionDenied`` unless this is an admin key.

        Args:
            what: what was asked, for the message ("the Admin service", "pinning").
        """
        if not self.is_admin:
            raise PermissionDenied(
                f"{what} needs an admin key; this key belongs to tenant {self.tenant!r}. "
                "Ask the gateway's operator, or send the request without it"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyEntry:
    """One configured key: its digest and whom it authenticates."""

    digest: bytes = field(repr=False)
    principal: Principal

    def __post_init__(self) -> None:
        if len(self.digest) != KEY_DIGEST_BYTES:
            raise ValueError(f"a key digest is {KEY_DIGEST_BYTES} bytes, got {len(self.digest)}")
        problem = tenant_id_problem(self.principal.tenant)
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def of_key(cls, key: str, tenant: str, *, is_admin: bool = False, where: str = "") -> KeyEntry:
        """An entry for the clear-text ``key`` (checked for length, never kept)."""
        problem = key_problem(key)
        if problem is not None:
            at = f" ({where})" if where else ""
            raise ValueError(f"the key for {tenant!r}{at} {problem}")
        return cls(digest=key_digest(key), principal=Principal(tenant=tenant, is_admin=is_admin))

    @classmethod
    def of_digest(cls, digest_hex: str, tenant: str, *, is_admin: bool = False) -> KeyEntry:
        """An entry for a key given by its digest (``key_digest(key).hex()``)."""
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError as exc:
            raise ValueError(
                f"the key digest for {tenant!r} is not hex: write key_digest(key).hex()"
            ) from exc
        return cls(digest=digest, principal=Principal(tenant=tenant, is_admin=is_admin))


def key_problem(key: str) -> str | None:
    """What is wrong with ``key`` as an API key, or None. The message never contains it.

    Besides length and characters, a key that is a placeholder left from an example
    (``REPLACE-...``, ``changeme``) or has little entropy (few distinct characters, one
    character making up much of it, or under ``MIN_KEY_BITS`` by ``key_guess_bits``: words,
    runs such as ``1234``) is refused: such a key would be guessed.
    """
    make_one = ("(generate one with: python3 -c 'import secrets; "
                "print(\"kvg-\" + secrets.token_urlsafe(24))')")
    if len(key) < MIN_KEY_CHARS:
        return (f"is {len(key)} characters long; use at least {MIN_KEY_CHARS} random characters "
                + make_one)
    if len(key) > MAX_KEY_CHARS:
        return f"is longer than {MAX_KEY_CHARS} characters"
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        return "must be printable ASCII without spaces (it travels in an HTTP/2 header)"
    lowered = key.lower()
    placeholder = next((word for word in PLACEHOLDER_WORDS if word in lowered), None)
    if placeholder is not None:
        return (f"looks like a placeholder (it contains {placeholder!r}); replace it with a "
                "random key " + make_one)
    most_common = max(key.count(c) for c in set(key))
    if len(set(key)) < MIN_DISTINCT_KEY_CHARS or most_common * 4 > len(key):
        return (f"has too little entropy ({len(set(key))} distinct characters, one of them "
                f"{most_common} times); use a random key " + make_one)
    bits = key_guess_bits(key)
    if bits < MIN_KEY_BITS:
        return (f"has too little entropy (about {bits:.0f} bits where {MIN_KEY_BITS} are "
                "needed: it is made of words, runs such as 1234 or abcd, or too few random "
                "characters); use a random key " + make_one)
    return None


def key_guess_bits(key: str) -> float:
    """A rough estimate of the bits an attacker must guess to find ``key``.

    In the manner of zxcvbn, but small: the key is read left to right as the cheapest of a
    known word (``GUESSABLE_WORDS``, any case, costing the bits to pick it from that list and
    one for capitals), a run of three or more characters each one above, below or equal to the
    one before (``1234``, ``cba``, ``aaa``: the bits of its first character, its length and
    direction), or one character (the bits of the character classes the key uses: lower case,
    upper case, digits, symbols). A random URL-safe key of 16 characters scores about 95 bits;
    ``Password1234567!`` about 24.
    """
    pool = sum(size for is_in, size in _CHAR_CLASSES if any(is_in(c) for c in key))
    char_bits = math.log2(max(pool, 2))
    word_bits = math.log2(len(GUESSABLE_WORDS))
    lowered = key.lower()
    bits = 0.0
    i = 0
    while i < len(key):
        word = next((w for w in _WORDS_LONGEST_FIRST if lowered.startswith(w, i)), None)
        run = _run_length(key, i)
        if word is not None and len(word) >= run:
            is_capitalised = key[i : i + len(word)] != word
            bits += word_bits + (1.0 if is_capitalised else 0.0)
            i += len(word)
        elif run >= 3:
            bits += char_bits + math.log2(run) + 1.0
            i += run
        else:
            bits += char_bits
            i += 1
    return bits


def _run_length(key: str, start: int) -> int:
    """Length of the run at ``start`` whose characters step by the same -1, 0 or +1."""
    if start + 1 >= len(key):
        return 1
    step = ord(key[start + 1]) - ord(key[start])
    if abs(step) > 1:
        return 1
    end = start + 1
    while end + 1 < len(key) and ord(key[end + 1]) - ord(key[end]) == step:
        end += 1
    return end - start + 1


def tenant_id_problem(tenant: str) -> str | None:
    """What is wrong with ``tenant`` as a tenant id, or None."""
    if not tenant:
        return "a tenant id must not be empty"
    if len(tenant) > MAX_TENANT_CHARS:
        return f"the tenant id {tenant[:40]!r}... is longer than {MAX_TENANT_CHARS} characters"
    if tenant in RESERVED_TENANTS:
        return f"the tenant id {tenant!r} is reserved (it names the shared scope)"
    if any(unicodedata.category(c).startswith("C") for c in tenant) or tenant != tenant.strip():
        return f"the tenant id {tenant!r} has control characters or surrounding spaces"
    return None


def parse_key_list(text: str, *, is_admin: bool, source: str) -> list[KeyEntry]:
    """Parse ``key1=tenantA,key2=tenantB`` (the ``KVGATE_API_KEYS`` form).

    For admin keys (``KVGATE_ADMIN_KEYS``) the part after ``=`` is the admin's name and may be
    left out (``key1,key2``: named ``admin``). The tenant is what follows the last ``=``, so a
    key may itself contain ``=``.

    Raises:
        ValueError: an entry is malformed; the message names its position, never the key.
    """
    entries = []
    for i, item in enumerate(part.strip() for part in text.split(",")):
        if not item:
            continue
        where = f"{source} entry {i + 1}"
        key, sep, tenant = item.rpartition("=")
        if not sep:
            if not is_admin:
                raise ValueError(f"{where} has no tenant: write key=tenant")
            key, tenant = item, DEFAULT_ADMIN_NAME
        tenant = tenant.strip()
        key = key.strip()
        problem = tenant_id_problem(tenant)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        entries.append(KeyEntry.of_key(key, tenant, is_admin=is_admin, where=where))
    return entries


def admin_tenant_clashes(entries: Sequence[KeyEntry]) -> list[str]:
    """Admin names that equal a tenant id (refused: an admin key sending prompts in the tenant
    scope would read and write that tenant's cache, whose scope is its name)."""
    tenants = {e.principal.tenant for e in entries if not e.principal.is_admin}
    return sorted({e.principal.tenant for e in entries if e.principal.is_admin} & tenants)


def tenants_without_keys(entries: Sequence[KeyEntry], tenants: Iterable[str]) -> list[str]:
    """Those of ``tenants`` that no key authenticates (a quota for one is likely a typo)."""
    keyed = {e.principal.tenant for e in entries}
    return sorted(t for t in tenants if t not in keyed)
