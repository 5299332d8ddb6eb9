"""The peak of the KV bytes a server's running requests hold, read from its ``/metrics``.

``kvgate_kv_bytes_in_use`` is what the running requests hold at a moment (their block tables'
pages, a cached prefix they share counted once; before the page pool, the buffers they
reserved). Polled every 50 ms -- what a router's scraper does -- while a load runs, its peak is
the figure ``kvgate bench load`` prints beside TTFT and req/s. ``kvgate_kv_tokens_in_use`` is
the tokens in those pages (a shared page counted once): its peak is the floor of any cache that
keeps each distinct token once, printed under the table beside the bytes' growth with users.
"""

from __future__ import annotations

import http.client
import threading
from types import TracebackType

from prometheus_client.parser import text_string_to_metric_families

METRIC = "kvgate_kv_bytes_in_use"
TOKENS_METRIC = "kvgate_kv_tokens_in_use"


def read_gauge(text: str, name: str = METRIC) -> float | None:
    """The value of an unlabelled gauge in a Prometheus text exposition, or None."""
    for family in text_string_to_metric_families(text):
        if family.name == name and family.samples:
            return float(family.samples[0].value)
    return None


class KVHeldPoller:
    """Polls ``http://host:port/metrics`` on a thread until the ``with`` block ends.

    ``peak_bytes`` (``peak_tokens``) is None where the server exposes no such gauge (or no
    metrics at all).
    """

    def __init__(self, host: str, port: int | None, *, interval_s: float = 0.05) -> None:
        self._host, self._port, self._interval_s = host, port, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-held-poller", daemon=True)
        self.peak_bytes: int | None = None
        self.peak_tokens: int | None = None

    def __enter__(self) -> KVHeldPoller:
        if self._port is not None:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        assert self._port is not None
        connection = http.client.HTTPConnection(self._host, self._port, timeout=5)
        try:
            while True:  # one poll at once, one after the stop: a short run still reads some
                stopping = self._stop.is_set()
                self._poll(connection)
                if stopping:
                    break
                self._stop.wait(self._interval_s)
        finally:
            connection.close()

    def _poll(self, connection: http.client.HTTPConnection) -> None:
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            body = response.read().decode()
        except (OSError, http.client.HTTPException):
            connection.close()
            return
        if response.status != 200:
            return
        value = read_gauge(body)
        if value is not None:
            self.peak_bytes = max(self.peak_bytes or 0, int(value))
        tokens = read_gauge(body, TOKENS_METRIC)
        if tokens is not None:
            self.peak_tokens = max(self.peak_tokens or 0, int(tokens))
