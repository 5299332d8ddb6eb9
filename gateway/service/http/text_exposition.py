"""Prometheus' plain text format (0.0.4) of a registry: ``prometheus_client``'s
``generate_latest``, byte for byte, at about a third of its formatting cost.

Why: the API port's ``/metrics`` is polled every 50 ms by routers' endpoint pickers and must
answer in a few milliseconds while the engine computes on the same cores. On the 2-core AMD
EPYC (AVX2) a render of the public registry took 3.2 ms of CPU in a serving gateway, over half
of it in ``generate_latest``'s per-sample formatting: every sample's metric name validated
against a regular expression and escaped, its labels sorted, escaped and joined again, although
the registry's series are the same scrape after scrape. Here each series' ``name{labels}`` is
formatted once and remembered; only the value is formatted per scrape. What is collected, and
how (``registry.collect()``), stays the library's; ``tests/gateway/service/http/
test_text_exposition.py`` holds this to ``generate_latest``'s output.

Only the default form of the format is rendered here (metric and label names escaped with
underscores, as ``generate_latest`` does when the scraper asks for nothing else); a scraper
that asks for OpenMetrics or another escaping gets the library's encoder
(``gateway.service.http.metrics_page``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_go_float = cast(Callable[[float], str], floatToGoString)
"""How the library writes a value (Go's float formatting); the library leaves it untyped."""

MAX_REMEMBERED_SERIES = 10_000
"""Series names remembered at most (the API port's registry has no per-tenant series and holds
a few hundred; past this the memory starts again rather than grow)."""

MAX_REMEMBERED_VALUES = 4_096
"""Formatted values remembered at most (then the memory starts again)."""

_SEPARATE_SUFFIXES = ("_created", "_gsum", "_gcount")
"""OpenMetrics samples the text format moves to a gauge of their own after their family."""

_TYPE_OF = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
            "unknown": "untyped"}
_NAME_SUFFIX = {"counter": "_total", "info": "_info"}


class TextExposition:
    """The text exposition of ``registry``, rendered anew at each ``render``.

    NOTE: not thread-safe (one renderer per thread; the API front renders on its one event
    loop thread).
    """

    def __init__(self, registry: Collector) -> None:
        self._registry = registry
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        self._headers: dict[tuple[str, str, str, bool], str] = {}
        self._values: dict[float, str] = {}

    def render(self) -> bytes:
        """What ``generate_latest(registry)`` returns now."""
        out: list[str] = []
        for metric in self._registry.collect():
            out.append(self._header(metric.name, metric.type, metric.documentation))
            separate: dict[str, list[str]] = {}
            for sample in metric.samples:
                suffix = sample.name[len(metric.name):]
                line = self._line(sample)
                if suffix in _SEPARATE_SUFFIXES and sample.name.startswith(metric.name):
                    separate.setdefault(suffix, []).append(line)
                else:
                    out.append(line)
            for suffix, lines in sorted(separate.items()):
                out.append(self._header(metric.name + suffix, "gauge", metric.documentation,
                                        munge=False))
                out.extend(lines)
        return "".join(out).encode("utf-8")

    def _header(self, name: str, kind: str, documentation: str, *, munge: bool = True) -> str:
        key = (name, kind, documentation, munge)
        header = self._headers.get(key)
        if header is None:
            shown_name = name + _NAME_SUFFIX.get(kind, "") if munge else name
            shown_kind = _TYPE_OF.get(kind, kind) if munge else kind
            escaped = escape_metric_name(shown_name)
            help_text = documentation.replace("\\", r"\\").replace("\n", r"\n")
            header = f"# HELP {escaped} {help_text}\n# TYPE {escaped} {shown_kind}\n"
            self._headers[key] = header
        return header

    def _line(self, sample: Sample) -> str:
        key = (sample.name, tuple(sample.labels.items()))
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= MAX_REMEMBERED_SERIES:
                self._series.clear()
            series = _series_text(sample)
            self._series[key] = series
        value = self._value_text(sample.value)
        if sample.timestamp is None:
            return f"{series} {value}\n"
        return f"{series} {value} {int(float(sample.timestamp) * 1000):d}\n"

    def _value_text(self, value: float) -> str:
        """``floatToGoString(value)``, remembered for positive values (counts and sums repeat
        from scrape to scrape; zero is left out, as -0.0 equals it but is written apart)."""
        text = self._values.get(value) if value > 0 else None
        if text is None:
            text = _go_float(value)
            if value > 0:
                if len(self._values) >= MAX_REMEMBERED_VALUES:
                    self._values.clear()
                self._values[value] = text
        return text


def _series_text(sample: Sample) -> str:
    """``name{label="value",...}`` as the text format writes a sample's series."""
    name = escape_metric_name(sample.name)
    if not sample.labels:
        return name
    labels = ",".join(f'{escape_label_name(key)}="{_escape_value(value)}"'
                      for key, value in sorted(sample.labels.items()))
    return f"{name}{{{labels}}}"


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def is_plain_text_encoder(encoder: object) -> bool:
    """Whether ``encoder`` (from ``choose_encoder``) is the default text format this module
    renders."""
    return encoder is generate_latest
