"""``DiskResponses``: stored responses on a replica's disk, kept over a restart, under the
deployment's MAC, bounded and expiring per tenant as ``MemoryResponses`` is."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.service.http.disk_responses import DiskResponses
from gateway.service.http.response_seal import responses_mac_key

TURN = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})
ONE, TWO, THREE = (f"resp_{i:024x}" for i in (1, 2, 3))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def store(root: Path, *, clock: Clock | None = None, secret: bytes = b"s" * 32,
          max_per_tenant: int = 3, max_chars: int = 1000,
          ttl_s: float | None = 10.0) -> DiskResponses:
    return DiskResponses(root, mac_key=responses_mac_key(secret), max_per_tenant=max_per_tenant,
                         max_chars_per_tenant=max_chars, default_ttl_s=ttl_s,
                         clock=clock or Clock())


def _file(root: Path) -> Path:
    (path,) = [p for p in root.rglob("*.json")]
    return path


def test_a_response_is_read_after_a_restart(tmp_path: Path) -> None:
    store(tmp_path).put(id=ONE, tenant="a", messages=TURN, body={"id": ONE})
    found = store(tmp_path).get("a", ONE)
    assert found is not None and found.messages == TURN and found.body == {"id": ONE}


def test_another_tenant_finds_nothing_and_deletes_nothing(tmp_path: Path) -> None:
    responses = store(tmp_path)
    responses.put(id=ONE, tenant="a", messages=TURN, body={})
    assert responses.get("b", ONE) is None and responses.delete("b", ONE) is False
    assert responses.get("a", ONE) is not None


def test_no_path_names_a_tenant(tmp_path: Path) -> None:
    store(tmp_path).put(id=ONE, tenant="tenant-secret-name", messages=TURN, body={})
    assert not any("tenant-secret-name" in str(p) for p in tmp_path.rglob("*"))


def test_an_id_kvgate_never_makes_reaches_no_path(tmp_path: Path) -> None:
    responses = store(tmp_path)
    for id in ("../../etc/passwd", "resp_*", "resp_" + "0" * 23 + "/"):
        assert responses.get("a", id) is None and responses.delete("a", id) is False


def test_a_changed_file_is_removed_and_read_as_missing(tmp_path: Path) -> None:
    responses = store(tmp_path)
    responses.put(id=ONE, tenant="a", messages=TURN, body={})
    path = _file(tmp_path)
    path.write_bytes(path.read_bytes().replace(b"hello", b"HELLO"))
    assert responses.get("a", ONE) is None and not path.exists()


def test_a_file_moved_to_another_id_or_tenant_fails_its_mac(tmp_path: Path) -> None:
    responses = store(tmp_path)
    responses.put(id=ONE, tenant="a", messages=TURN, body={})
    responses.put(id=TWO, tenant="b", messages=TURN, body={})
    mine = next(p for p in tmp_path.rglob(f"{ONE}.*.json"))
    theirs_dir = next(p for p in tmp_path.rglob(f"{TWO}.*.json")).parent
    os.replace(mine, theirs_dir / mine.name.replace(ONE, THREE))
    assert responses.get("b", THREE) is None


def test_a_replica_with_another_secret_reads_nothing(tmp_path: Path) -> None:
    store(tmp_path).put(id=ONE, tenant="a", messages=TURN, body={})
    assert store(tmp_path, secret=b"t" * 32).get("a", ONE) is None


def test_each_read_refreshes_the_expiry_and_an_idle_response_expires(tmp_path: Path) -> None:
    clock = Clock()
    responses = store(tmp_path, clock=clock)
    responses.put(id=ONE, tenant="a", messages=TURN, body={})
    os.utime(_file(tmp_path), (clock.now, clock.now))
    clock.now += 9.0
    assert responses.get("a", ONE) is not None  # due 10 s from now
    clock.now += 9.5
    assert responses.get("a", ONE) is not None
    clock.now += 10.0
    assert responses.get("a", ONE) is None


def test_one_more_than_the_limit_drops_the_tenants_least_recently_used(tmp_path: Path) -> None:
    clock = Clock()
    responses = store(tmp_path, clock=clock, max_per_tenant=2)
    for at, id in enumerate((ONE, TWO)):
        responses.put(id=id, tenant="a", messages=TURN, body={})
        path = next(tmp_path.rglob(f"{id}.*.json"))
        os.utime(path, (clock.now + at, clock.now + at))
    clock.now += 5
    assert responses.get("a", ONE) is not None  # TWO is now the least recently used
    responses.put(id=THREE, tenant="a", messages=TURN, body={})
    assert [id for id in (ONE, TWO, THREE) if responses.get("a", id) is not None] == [ONE, THREE]


def test_past_the_character_budget_the_least_recently_used_go_first(tmp_path: Path) -> None:
    responses = store(tmp_path, max_per_tenant=10, max_chars=20)
    chat = ({"role": "user", "content": "x" * 6}, {"role": "assistant", "content": "y" * 2})
    for at, id in enumerate((ONE, TWO, THREE)):  # 8 characters each: the third pushes one out
        responses.put(id=id, tenant="a", messages=chat, body={})
        path = next(tmp_path.rglob(f"{id}.*.json"))
        os.utime(path, (1000.0 + at, 1000.0 + at))
    assert responses.chars_of("a") == 16
    assert next(iter(tmp_path.rglob(f"{ONE}.*.json")), None) is None
