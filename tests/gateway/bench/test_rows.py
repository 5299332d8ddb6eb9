"""The records of a TTFT run (``gateway.bench.rows``): medians, what served a row, and whether
a kvgate row was served from the tier it was meant to be."""

from __future__ import annotations

from gateway.bench.rows import COLD, DISK, LengthResult, Row, Sample


def sample(seconds: float, served_from: str, cached: int = 512,
           server_ms: float | None = None) -> Sample:
    return Sample(seconds=seconds, cached_tokens=cached, served_from=served_from,
                  server_ms=server_ms)


def test_a_row_shows_medians_and_what_served_it() -> None:
    row = Row(label=DISK, system="kvgate", tier="disk", samples=[
        sample(0.3, "disk:512", server_ms=2.0), sample(0.1, "disk:512"),
        sample(0.2, "disk:512", server_ms=4.0)])
    assert row.median_s == 0.2
    assert row.server_median_ms == 3.0
    assert row.cached_text == "512"
    assert row.served_text == "disk:512"
    assert row.is_served_as_meant


def test_a_row_served_elsewhere_says_so_and_is_not_as_meant() -> None:
    row = Row(label=DISK, system="kvgate", tier="disk", samples=[
        sample(0.1, "disk:512"), sample(0.1, "host:512"), sample(0.1, "host:512")])
    assert row.served_text == "host:512 x2, disk:512 x1"
    assert not row.is_served_as_meant
    empty = Row(label=COLD, system="kvgate", note="n/a")
    assert empty.median_s is None and empty.cached_text == "-"
    assert not empty.is_served_as_meant


def test_a_length_finds_its_rows_by_label() -> None:
    result = LengthResult(prefix_tokens=512, rows=[Row(label=COLD, system="kvgate")])
    assert result.row(COLD) is result.rows[0]
    assert result.row(DISK) is None
