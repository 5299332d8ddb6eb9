"""``MemoryResponses`` on a fake clock: tenants apart, expiry sliding, least recently used out
past a count or a number of characters."""

from __future__ import annotations

from gateway.service.http.stored_responses import MemoryResponses

TURN = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store(clock: Clock, *, max_per_tenant: int = 3, max_chars: int = 1000,
          ttl_s: float | None = 10.0) -> MemoryResponses:
    return MemoryResponses(max_per_tenant=max_per_tenant, max_chars_per_tenant=max_chars,
                           default_ttl_s=ttl_s, clock=clock)


def test_a_response_is_found_by_its_tenant_only() -> None:
    responses = store(Clock())
    responses.put(id="resp_1", tenant="a", messages=TURN, body={"id": "resp_1"})
    found = responses.get("a", "resp_1")
    assert found is not None and found.messages == TURN and found.body == {"id": "resp_1"}
    assert responses.get("b", "resp_1") is None
    assert responses.delete("b", "resp_1") is False
    assert responses.get("a", "resp_1") is not None


def test_each_read_refreshes_the_expiry_and_an_idle_response_expires() -> None:
    clock = Clock()
    responses = store(clock)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})
    clock.now = 9.0
    assert responses.get("a", "resp_1") is not None  # due at 19 now
    clock.now = 18.5
    assert responses.get("a", "resp_1") is not None  # due at 28.5
    clock.now = 28.5
    assert responses.get("a", "resp_1") is None


def test_a_request_ttl_overrides_the_default() -> None:
    clock = Clock()
    responses = store(clock)
    responses.put(id="resp_day", tenant="a", messages=TURN, body={}, ttl_s=86400.0)
    clock.now = 86399.0
    found = responses.get("a", "resp_day")
    assert found is not None and found.ttl_s == 86400.0


def test_one_more_than_the_limit_drops_the_tenants_least_recently_used() -> None:
    responses = store(Clock(), max_per_tenant=2)
    for name in ("resp_1", "resp_2"):
        responses.put(id=name, tenant="a", messages=TURN, body={})
    responses.put(id="resp_b", tenant="b", messages=TURN, body={})
    assert responses.get("a", "resp_1") is not None  # resp_2 is now the least recent
    responses.put(id="resp_3", tenant="a", messages=TURN, body={})
    assert [name for name in ("resp_1", "resp_2", "resp_3")
            if responses.get("a", name) is not None] == ["resp_1", "resp_3"]
    assert responses.get("b", "resp_b") is not None  # another tenant's are not its room


def test_deleting_an_expired_response_says_it_was_gone() -> None:
    clock = Clock()
    responses = store(clock)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})
    clock.now = 10.0
    assert responses.delete("a", "resp_1") is False


def test_past_the_character_budget_the_tenants_least_recently_used_go_first() -> None:
    responses = store(Clock(), max_per_tenant=10, max_chars=20)
    chat = ({"role": "user", "content": "x" * 6}, {"role": "assistant", "content": "y" * 2})
    for name in ("resp_1", "resp_2"):  # 8 characters each
        responses.put(id=name, tenant="a", messages=chat, body={})
    responses.put(id="resp_b", tenant="b", messages=chat, body={})
    assert responses.chars_of("a") == 16
    responses.put(id="resp_3", tenant="a", messages=chat, body={})  # 24 > 20: resp_1 goes
    assert [name for name in ("resp_1", "resp_2", "resp_3")
            if responses.get("a", name) is not None] == ["resp_2", "resp_3"]
    assert responses.chars_of("a") == 16 and responses.chars_of("b") == 8
    responses.delete("a", "resp_2")
    assert responses.chars_of("a") == 8


def test_one_response_over_the_budget_alone_is_kept_and_pushes_out_the_rest() -> None:
    responses = store(Clock(), max_chars=10)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})
    big = ({"role": "user", "content": "z" * 50},)
    responses.put(id="resp_big", tenant="a", messages=big, body={})
    assert responses.get("a", "resp_1") is None
    assert responses.get("a", "resp_big") is not None and responses.chars_of("a") == 50
