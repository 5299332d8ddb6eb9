"""The metrics scrape token: who may read ``GET /metrics`` when ``[metrics]`` sets one.

An open ``/metrics`` is a side channel. Its series carry no tenant, key or prompt, but on a
quiet replica one tenant's request is the only change between two scrapes, so the deltas of
``kvgate_prompt_tokens_total`` and the TTFT histogram give that request's prompt size, its
cache hit and its timing (issue 44: 290 and 288 tokens read off another tenant's chat). With a
token configured (``[metrics] scrape_token_file``, ``KVGATE_METRICS_TOKEN`` or
``KVGATE_METRICS_TOKEN_FILE``), both places that serve metrics -- the API port's ``/metrics``
and ``[metrics]``' own port -- answer only a scrape that sends ``Authorization: Bearer
<token>``, as Prometheus (``authorization`` in a scrape config), the Prometheus Operator
(``ServiceMonitor.endpoints[].authorization``) and a router's metrics client send it; any other
is a 401 that says what to send. Without one (the default) both stay open, as before.

The token is kept as its BLAKE2b digest only, and a presented token is hashed and compared
with ``hmac.compare_digest``, as API keys are (``gateway.service.auth``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from typing import Any

from gateway.config.keys import key_digest
from gateway.config.settings import MetricsSettings

REFUSAL = ("this /metrics needs the scrape token: send the header `Authorization: Bearer "
           "<token>` with the token of [metrics] scrape_token_file or KVGATE_METRICS_TOKEN "
           "(Prometheus: `authorization: {credentials_file: ...}` in the scrape config)")
"""The 401's message: what to send, never the token or why a given one failed."""

CHALLENGE = 'Bearer realm="kvgate metrics"'
"""The 401's ``WWW-Authenticate`` header (RFC 6750)."""


class ScrapeToken:
    """Checks a scrape's ``Authorization`` header against the configured token's digest.

    Args:
        digest: ``key_digest`` of the token (``MetricsSettings.scrape_token_digest``).
    """

    def __init__(self, digest: bytes) -> None:
        self._digest = digest

    def allows(self, authorization: str | None) -> bool:
        """Whether a scrape with this ``Authorization`` header value (None: none sent) may
        read the metrics: ``Bearer <the token>``, the scheme in any case."""
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(key_digest(token.strip()), self._digest)


def scrape_token_of(settings: MetricsSettings) -> ScrapeToken | None:
    """The token ``settings`` configure, or None (both ``/metrics`` open)."""
    digest = settings.scrape_token_digest
    return ScrapeToken(digest) if digest is not None else None


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def guarded_wsgi(app: WsgiApp, token: ScrapeToken) -> WsgiApp:
    """``app`` (``[metrics]``' own port, ``prometheus_client``'s WSGI app) answering only a
    request that carries the token; any other gets the 401."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if token.allows(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        body = (REFUSAL + "\n").encode()
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("Content-Length", str(len(body))),
                                            ("WWW-Authenticate", CHALLENGE)])
        return [body]

    return guarded
