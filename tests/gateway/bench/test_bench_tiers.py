"""``kvgate bench tiers``' codec table: every row is there with positive figures, and the block
MAC's share of encode and decode is reported. Speed is never asserted."""

from __future__ import annotations

import io
from pathlib import Path

from gateway.bench.tiers import Row, codec_rows, plot_tiers, write_codec_table
from tests.tiers.conftest import make_test_codec, seeded_block_meta, seeded_kv_block


def test_codec_table_reports_the_block_mac_and_its_share_of_encode_and_decode() -> None:
    codec = make_test_codec()
    blocks = [seeded_kv_block(seed) for seed in range(3)]
    metas = [seeded_block_meta(seed) for seed in range(3)]
    rows = codec_rows(blocks, metas, codec, repeats=2)
    assert [r.operation for r in rows] == [
        "encode",
        "decode (verified)",
        "block MAC: keyed BLAKE3",
        "  vs HMAC-SHA256",
        "  vs keyed BLAKE2b",
    ]
    assert all(r.seconds_per_block > 0 and r.block_bytes == codec.raw_len for r in rows)
    assert [r.mac_share is not None for r in rows] == [True, True, False, False, False]
    out = io.StringIO()
    write_codec_table(rows, out)
    assert "MAC share" in out.getvalue()
    assert out.getvalue().count("%") == 2


def test_the_table_is_drawn_as_a_png_with_kvgate_beside_each_raw_limit(tmp_path: Path) -> None:
    rows = [Row(tier="host", operation="get", seconds=0.005, num_bytes=94_400_000,
                limit_name="tensor clone", limit_seconds=0.005),
            Row(tier="disk", operation="get", seconds=0.010, num_bytes=94_400_000,
                limit_name="plain read", limit_seconds=0.023)]
    out = io.StringIO()
    assert plot_tiers(rows, tmp_path / "tiers.png", out)
    assert (tmp_path / "tiers.png").read_bytes().startswith(b"\x89PNG")
    assert f"plot: {tmp_path / 'tiers.png'}" in out.getvalue()
