"""The access log: one line per finished request, on the ``kvgate.access`` logger.

Both fronts write it when a request ends (the gRPC dispatch for Generate, Warm and Lookup; the
HTTP front for chat and completions), with what its caller would want to know of it: who
(tenant), which API, how the prompt was served (prompt tokens, cached tokens by tier, computed
tokens), how much was generated, how fast (TTFT and total, milliseconds) and how it ended::

    tenant=acme api=http.chat status=200 finish=stop prompt_tokens=120 cached_tokens=64
    cached_device=64 computed_tokens=56 completion_tokens=16 ttft_ms=12.3 total_ms=80.1

(a generation that read lossy copies, ``CacheOptions.allow_lossy``, names their tier with its
format, ``cached_disk:int8=1920``, and adds ``lossy=true``: an operator looking into an odd
answer sees that it was not the model's own), or, with ``[logging] json = true``, the same
fields as one JSON object (``cached_tokens_by_tier`` a nested object). Never prompt text,
completion text, keys, namespaces or block keys: a line is made only from the fields of
``AccessEntry``, counts and names the operator chose (tenant ids).

NOTE: the line is the whole message, so a log collector that wants only JSON routes the
``kvgate.access`` logger to a handler with ``%(message)s`` as its format.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.core.requests import Usage

ACCESS_LOGGER = "kvgate.access"


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessEntry:
    """One finished request, as its front saw it.

    Attributes:
        tenant: the caller's tenant (``-`` if it was never authenticated).
        api: ``grpc.Generate``, ``grpc.Warm``, ``grpc.Lookup``, ``http.chat``,
            ``http.completion``.
        status: how the call ended: the gRPC status code name or the HTTP status.
        total_s: from the call reaching its handler to its end.
        finish: the generation's finish reason (None: not a generation, or none ended).
        prompt_tokens: tokens of the prompt (None: unknown, the call failed before).
        cached_tokens_by_tier: of them, served by each cache tier (None: not known, as for a
            Warm, whose answer counts blocks; cached and computed tokens are then left out).
        completion_tokens: tokens generated.
        ttft_ms: the generation's time to first token, from its submission to the engine.
        lossy: the answer was computed on lossy (quantized) K/V (``Usage.lossy``); written
            only when true, so exact answers' lines are as before.
    """

    tenant: str
    api: str
    status: str
    total_s: float
    finish: str | None = None
    prompt_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    lossy: bool = False

    def fields(self) -> dict[str, object]:
        """The line's fields, in order (None values left out)."""
        cached = sum((self.cached_tokens_by_tier or {}).values())
        prompt = self.prompt_tokens
        known = prompt is not None and self.cached_tokens_by_tier is not None
        values: dict[str, object | None] = {
            "tenant": self.tenant, "api": self.api, "status": self.status,
            "finish": self.finish, "prompt_tokens": prompt,
            "cached_tokens": cached if known else None,
            "cached_tokens_by_tier": self.cached_tokens_by_tier if known else None,
            "computed_tokens": max(0, prompt - cached) if prompt is not None and known else None,
            "lossy": True if self.lossy else None,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 1),
            "total_ms": round(self.total_s * 1e3, 1),
        }
        return {name: value for name, value in values.items() if value is not None}


class AccessLog:
    """Writes ``AccessEntry``s as lines of ``logger`` (INFO), or nothing when off.

    Args:
        is_enabled: ``[logging] access_log``.
        is_json: ``[logging] json``: one JSON object per line instead of ``key=value`` pairs.
        logger: where lines go (the ``kvgate.access`` logger by default).
    """

    def __init__(self, *, is_enabled: bool = True, is_json: bool = False,
                 logger: logging.Logger | None = None) -> None:
        self._is_enabled = is_enabled
        self._is_json = is_json
        self._logger = logger if logger is not None else logging.getLogger(ACCESS_LOGGER)

    @property
    def is_enabled(self) -> bool:
        return self._is_enabled and self._logger.isEnabledFor(logging.INFO)

    def write(self, entry: AccessEntry) -> None:
        """Log ``entry`` (one line)."""
        if not self.is_enabled:
            return
        self._logger.info("%s", format_fields(entry.fields(), is_json=self._is_json))


class AccessCall:
    """One call on its way to its line: the front notes what it learns, then ends it once.

    Args:
        log: where the line goes (None: nowhere; every method is then a no-op).
        api: the API's name in the line (``grpc.Generate``, ``http.chat``).
        tenant: the caller's tenant, if known yet (``-`` until then).
        clock: monotonic seconds.
    """

    def __init__(self, log: AccessLog | None, api: str, *, tenant: str = "-",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log if log is not None and log.is_enabled else None
        self._api = api
        self.tenant = tenant
        self._clock = clock
        self._began = clock()
        self._fields: dict[str, Any] = {}
        self._is_ended = False

    def note(self, **fields: Any) -> None:
        """Keep ``AccessEntry`` fields (prompt_tokens, cached_tokens_by_tier, ...)."""
        self._fields.update(fields)

    def saw_usage(self, usage: Usage) -> None:
        """Keep a generation's counts, TTFT and finish reason."""
        self.note(prompt_tokens=usage.prompt_tokens,
                  cached_tokens_by_tier=dict(usage.cached_tokens_by_tier),
                  completion_tokens=usage.completion_tokens, ttft_ms=usage.ttft_ms,
                  finish=usage.finish_reason, lossy=usage.lossy)

    def end(self, status: str) -> None:
        """Write the line with ``status`` (only the first call writes)."""
        if self._is_ended:
            return
        self._is_ended = True
        if self._log is not None:
            self._log.write(AccessEntry(tenant=self.tenant, api=self._api, status=status,
                                        total_s=self._clock() - self._began, **self._fields))


def format_fields(values: dict[str, object], *, is_json: bool) -> str:
    """``values`` as one JSON object, or as ``key=value`` pairs (a dict value flattened to
    ``key_subkey=value``: ``cached_tokens_by_tier={"device": 64}`` is ``cached_device=64``)."""
    if is_json:
        return json.dumps(values, separators=(",", ":"), sort_keys=False)
    parts: list[str] = []
    for name, value in values.items():
        if isinstance(value, dict):
            prefix = name.removesuffix("_tokens_by_tier").removesuffix("_by_tier")
            parts.extend(f"{prefix}_{key}={_plain(item)}" for key, item in sorted(value.items()))
        else:
            parts.append(f"{name}={_plain(value)}")
    return " ".join(parts)


def _plain(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}" if abs(value) < 1e6 else f"{value:.0f}"
    return str(value)
