"""``kvgate bench tiers``' codec table: every row is there with positive figures, and the block
MAC's share of encode and decode is reported; the whole run on the tiny Llama keeps its K/V in
the dtype it was given. Speed is never asserted."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gateway.bench.numerics import resolve_numerics
from gateway.bench.tiers import Row, codec_rows, plot_tiers, run_tiers_benchmark, write_codec_table
from tests.tiers.conftest import make_test_codec, seeded_block_meta, seeded_kv_block
from tests.tiny_llama import save_tiny_llama


def test_codec_table_reports_the_block_mac_and_its_share_of_encode_and_decode() -> None:
    codec = make_test_codec()
    blocks = [seeded_kv_block(seed) for seed in range(3)]
    metas = [seeded_block_meta(seed) for seed in range(3)]
    rows = codec_rows(blocks, metas, codec, repeats=2)
    assert [r.operation for r in rows] == [
        "encode",
        "decode (verified)",
        "block MAC: keyed BLAKE3",
        "  on every core (GPU)",
        "  vs HMAC-SHA256",
        "  vs keyed BLAKE2b",
    ]
    assert all(r.seconds_per_block > 0 and r.block_bytes == codec.raw_len for r in rows)
    assert [r.mac_share is not None for r in rows] == [True, True, False, False, False, False]
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_tier_is_measured_on_kv_in_the_dtype_given(tmp_path: Path, device: str) -> None:
    model = save_tiny_llama(tmp_path / "model")
    out = io.StringIO()
    numerics = resolve_numerics(device, "bfloat16")
    rows = run_tiers_benchmark(model=str(model), cache_dir=tmp_path / "cache", repeats=1,
                               out=out, prompt_tokens=64, block_tokens=16, numerics=numerics)
    assert [(r.tier, r.operation) for r in rows][:6] == [
        ("host", "put"), ("host", "get"), ("host->device", "promote"),
        ("device", "copy into request"), ("disk", "put (fsync)"), ("disk", "get")]
    # 4 blocks x (K, V) x 2 layers x 2 KV heads x 16 tokens x head_dim 16, 2 bytes each
    assert {r.num_bytes for r in rows} == {4 * 2 * 2 * 2 * 16 * 16 * 2}
    assert all(r.seconds > 0 and r.limit_seconds > 0 for r in rows)
    assert f"K/V {numerics.describe()}" in out.getvalue()
    assert f"request's copy are {numerics.describe()}" in out.getvalue()
