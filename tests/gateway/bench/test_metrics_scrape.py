"""``kvgate bench metrics``' scraper: both ways of scraping ``/metrics`` and the ``/health``
floor, timed, against a real HTTP server on loopback (the whole bench spawns ``kvgate serve``:
docs/operations.md)."""

from __future__ import annotations

import http.server
import shutil
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.bench.metrics_scrape import (
    CURL,
    HEALTH,
    KEEP_ALIVE,
    NEW_CONNECTION,
    ROUTER_SERIES,
    Scraper,
)
from gateway.bench.rows import BenchError


class _Front(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps connections alive, as the gateway's front does
    metrics_status = 200

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/metrics":
            status, body = self.metrics_status, ROUTER_SERIES + b"{} 0\n"
        elif self.path == "/health":
            status, body = 200, b"ok"
        else:
            status, body = 404, b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def front() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Front)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        _Front.metrics_status = 200


def test_every_round_times_a_kept_scrape_a_new_one_and_the_health_floor(front) -> None:
    scraper = Scraper("127.0.0.1", front.server_address[1], interval_s=0.02)
    scraper.start()
    time.sleep(0.3)
    times = scraper.stop()
    kept, new, health = (times.seconds[kind] for kind in (KEEP_ALIVE, NEW_CONNECTION, HEALTH))
    assert len(kept) >= 3 and len(health) == len(kept) and len(new) >= len(kept) - 1
    assert all(0 < seconds < 5 for seconds in (*kept, *new, *health))
    assert times.num_bytes > len(ROUTER_SERIES)


def test_with_curl_every_other_new_connection_scrape_is_timed_by_curl(front) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on PATH")
    scraper = Scraper("127.0.0.1", front.server_address[1], interval_s=0.02, curl=curl)
    scraper.start()
    time.sleep(2.0)  # rounds with curl: a loaded 2-core CI machine fitted one in 0.4 s
    times = scraper.stop()
    new, by_curl = times.seconds[NEW_CONNECTION], times.seconds[CURL]
    assert len(by_curl) >= 2 and abs(len(new) - len(by_curl)) <= 1
    assert all(0 < seconds < 5 for seconds in by_curl)


def test_a_scrape_that_is_not_200_fails_the_bench_saying_so(front) -> None:
    _Front.metrics_status = 503
    scraper = Scraper("127.0.0.1", front.server_address[1], interval_s=0.02)
    scraper.start()
    time.sleep(0.1)
    with pytest.raises(BenchError, match="answered 503"):
        scraper.stop()
