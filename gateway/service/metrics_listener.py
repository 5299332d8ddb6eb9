"""``[metrics]``' own port: every series, per-tenant ones too, over a small WSGI server.

It is ``prometheus_client``'s WSGI app on ``wsgiref`` (as ``start_http_server`` serves it),
built here so that the app can be wrapped by the scrape token's check
(``gateway.service.scrape_token``) and the server stays quiet (no stderr line per scrape).
"""

from __future__ import annotations

import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from gateway.service.scrape_token import ScrapeToken, guarded_wsgi


class MetricsListener:
    """Serves ``registry`` at ``/metrics`` on a thread of its own once started.

    Args:
        registry: what to render (every series).
        scrape_token: what a scrape must send (None: nothing; 401 otherwise).
    """

    def __init__(self, registry: CollectorRegistry, *,
                 scrape_token: ScrapeToken | None = None) -> None:
        self._registry = registry
        self._scrape_token = scrape_token
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a free port) and serve; returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        app = make_wsgi_app(self._registry)
        if self._scrape_token is not None:
            app = guarded_wsgi(app, self._scrape_token)
        server_class = type("_MetricsServer", (ThreadingWSGIServer,),
                            {"address_family": socket.getaddrinfo(host, port)[0][0]})
        server: WSGIServer = make_server(host, port, app, server_class,
                                         handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, name="kvgate-metrics",
                                  daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        return int(server.server_port)

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape (``wsgiref``'s default), as ``prometheus_client``'s own."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Nothing: a scrape is counted by its own metrics, never written to stderr."""
