"""The stubs in ``gateway/service/pb/`` are what ``python -m gateway.service.protogen`` makes."""

from __future__ import annotations

from pathlib import Path

from gateway.service.pb import kvgate_pb2, kvgate_pb2_grpc
from gateway.service.protogen import STUB_NAMES, STUBS_DIR, generate


def test_the_stubs_are_up_to_date(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert [p.name for p in written] == list(STUB_NAMES)
    for name in STUB_NAMES:
        assert (tmp_path / name).read_bytes() == (STUBS_DIR / name).read_bytes(), (
            f"gateway/service/pb/{name} is out of date: run `python -m gateway.service.protogen`"
        )


def test_the_stubs_import_as_part_of_the_gateway_package() -> None:
    assert kvgate_pb2.DESCRIPTOR.name == "kvgate/v1/kvgate.proto"
    assert kvgate_pb2.DESCRIPTOR.package == "kvgate.v1"
    assert {s for s in kvgate_pb2.DESCRIPTOR.services_by_name} == {"Gateway", "Admin"}
    assert vars(kvgate_pb2_grpc)["kvgate_dot_v1_dot_kvgate__pb2"] is kvgate_pb2
    source = Path(kvgate_pb2_grpc.__file__).read_text(encoding="utf-8")
    assert "from . import kvgate_pb2" in source and "from kvgate" not in source
