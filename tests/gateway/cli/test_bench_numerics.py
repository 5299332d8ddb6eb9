"""``--device`` and ``--dtype`` of ``kvgate bench ttft|tiers|load|chunks``: checked by the same
code as ``kvgate serve``'s flags; a malformed value or a device this machine lacks is a usage
error (exit status 2) that names the flag, before anything is loaded or spawned."""

from __future__ import annotations

import pytest

from gateway.cli.main import build_parser, main

BENCHES = ("ttft", "tiers", "load", "chunks")


@pytest.mark.parametrize("bench", BENCHES)
def test_device_and_dtype_default_to_auto_as_for_serve(bench: str) -> None:
    args = build_parser().parse_args(["bench", bench])
    assert (args.device, args.dtype) == ("auto", "auto")


@pytest.mark.parametrize("bench", BENCHES)
def test_every_spelling_serve_accepts_is_accepted(bench: str) -> None:
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16"), ("cuda:1", "float16")):
        args = build_parser().parse_args(["bench", bench, "--device", device, "--dtype", dtype])
        assert (args.device, args.dtype) == (device, dtype)


@pytest.mark.parametrize("bench", BENCHES)
@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--device", "gpu0", "argument --device: must be auto, cpu, cuda or cuda:N, got 'gpu0'"),
    ("--dtype", "fp8",
     "argument --dtype: must be auto, float32, bfloat16 or float16, got 'fp8'"),
])
def test_a_malformed_value_is_a_usage_error_listing_the_choices(
    bench: str, flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", bench, flag, value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("bench", BENCHES)
def test_a_device_this_machine_lacks_is_a_usage_error_before_anything_runs(
    bench: str, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", bench, "--device", "cuda:99"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"kvgate bench {bench}: --device cuda:99: ")
    assert captured.out == ""  # nothing measured, nothing loaded
