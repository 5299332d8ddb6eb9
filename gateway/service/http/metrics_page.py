"""``GET /metrics``' body on the API port: rendered at most once per ``max_age_s`` per format.

Rendering the public registry is most of a scrape's cost (about 1 ms of CPU for 13 KiB of text
with the histograms populated, 2-3 in a serving gateway whose caches went cold between polls;
the HTTP exchange around it about 1 ms: docs/operations.md, "Cost of a scrape"), and it runs
on the front's event loop. The API port's ``/metrics`` is polled by more than one reader at once --
a router's endpoint pickers (every 50 ms each, often several replicas of them), Prometheus,
an operator's ``curl`` -- so a body rendered less than ``max_age_s`` ago is served again
instead of rendered anew. ``max_age_s`` (20 ms) stays under the fastest poll interval (50 ms):
one poller always gets a fresh render; pollers that arrive together share one, and no reader
sees figures older than 20 ms. The plain text format, what routers and ``curl`` get, is
rendered by ``gateway.service.http.text_exposition`` (the library's output, at a fraction of
its cost); OpenMetrics and other escapings by the library's own encoders.

NOTE: used from the front's one event loop thread only, so the cache takes no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from gateway.service.http.text_exposition import TextExposition, is_plain_text_encoder

DEFAULT_MAX_AGE_S = 0.02
"""The oldest body served again: under a router's 50 ms poll interval."""


class MetricsPage:
    """The exposition of ``registry``, in the format a scraper asks for.

    Args:
        registry: what to render (the API port's: no per-tenant series).
        max_age_s: a body rendered this recently is served again (0: render every scrape).
        clock: monotonic seconds (a fake one in tests).
    """

    def __init__(self, registry: CollectorRegistry, *, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._text = TextExposition(registry)
        self._max_age_s = max_age_s
        self._clock = clock
        self._rendered: dict[str, tuple[float, bytes]] = {}
        self.num_renders = 0

    def render(self, accept: str) -> tuple[bytes, str]:
        """The body and its Content-Type for a request's ``Accept`` header (Prometheus' text
        format, or OpenMetrics when asked for)."""
        encoder, content_type = choose_encoder(accept)
        now = self._clock()
        cached = self._rendered.get(content_type)
        if cached is not None and now - cached[0] < self._max_age_s:
            return cached[1], content_type
        body = self._text.render() if is_plain_text_encoder(encoder) else encoder(self._registry)
        self.num_renders += 1
        self._rendered[content_type] = (now, body)
        return body, content_type
