"""Where a prompt departs from an earlier one, and what is kept to tell (``miss_diagnosis``)."""

from __future__ import annotations

from gateway.core.canonical import PromptInput
from gateway.service.miss_diagnosis import (
    UNKNOWN,
    Diagnosis,
    Divergence,
    KeptShape,
    KeptShapes,
    PromptShape,
    ShapeDigests,
    diagnose,
    divergence,
    first_difference,
    missed_tokens,
)

DIGESTS = ShapeDigests(key=b"k" * 32)
SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "one two three"}
ANSWER = {"role": "assistant", "content": "four"}


def _shape(*messages: dict[str, str], model: str = "m", tools: list[dict[str, object]] | None
           = None, key: str | None = None) -> PromptShape:
    return DIGESTS.shape(model=model, prompt=PromptInput(messages=list(messages), tools=tools),
                         prompt_cache_key=key)


def _words(prompt: PromptInput) -> int:
    """A token count for the tests: one token per word of every message."""
    return sum(len(str(message["content"]).split()) for message in prompt.messages or ())


def test_a_conversation_that_only_appends_turns_departs_nowhere() -> None:
    assert divergence(_shape(SYSTEM, ASK), _shape(SYSTEM, ASK, ANSWER, ASK)) is None


def test_each_part_is_named_in_prompt_order() -> None:
    earlier = _shape(SYSTEM, ASK)
    assert divergence(earlier, _shape(SYSTEM, ASK, model="n")) == Divergence("model")
    assert divergence(earlier, _shape(SYSTEM, ASK, key="k")) == Divergence("prompt_cache_key")
    assert divergence(earlier, _shape(SYSTEM, ASK, tools=[{"name": "t"}])) == Divergence("tools")
    assert divergence(earlier, _shape({"role": "system", "content": "x"}, ASK)) == Divergence(
        "system")


def test_an_edited_message_names_its_index_after_the_system_messages() -> None:
    earlier = _shape(SYSTEM, ASK, ANSWER, ASK)
    edited = _shape(SYSTEM, ASK, {"role": "assistant", "content": "five"}, ASK)
    assert divergence(earlier, edited) == Divergence("messages", 1)


def test_a_shorter_conversation_departs_where_it_ends() -> None:
    assert divergence(_shape(SYSTEM, ASK, ANSWER), _shape(SYSTEM, ASK)) == Divergence(
        "messages", 1)


def test_a_change_before_the_messages_misses_every_reusable_token() -> None:
    kept = KeptShape(shape=_shape(SYSTEM, ASK), reusable_tokens=64)
    assert missed_tokens(kept, Divergence("system"), PromptInput(messages=[SYSTEM]), _words) == 64


def test_a_changed_message_misses_what_follows_the_shared_turns() -> None:
    kept = KeptShape(shape=_shape(SYSTEM, ASK), reusable_tokens=64)
    prompt = PromptInput(messages=[SYSTEM, ASK, ANSWER, {"role": "user", "content": "six"}])
    # the third message after the system one differs: shared are 3 + 3 + 1 words
    assert missed_tokens(kept, Divergence("messages", 2), prompt, _words) == 64 - 7


def test_digests_under_another_key_differ_and_hold_no_text() -> None:
    ours = _shape(SYSTEM, ASK)
    theirs = ShapeDigests(key=b"j" * 32).shape(model="m", prompt=PromptInput(
        messages=[SYSTEM, ASK]))
    assert ours != theirs
    assert b"terse" not in b"".join([ours.system, *ours.messages])


def test_kept_shapes_belong_to_their_tenant() -> None:
    kept = KeptShapes()
    shape = KeptShape(shape=_shape(ASK), reusable_tokens=0)
    kept.put("a", "msg_1", shape)
    assert kept.get("a", "msg_1") == shape and kept.get("b", "msg_1") is None


def test_a_kept_shape_expires_its_ttl_after_its_last_use() -> None:
    now = [0.0]
    kept = KeptShapes(ttl_s=10.0, clock=lambda: now[0])
    kept.put("a", "msg_1", KeptShape(shape=_shape(ASK), reusable_tokens=0))
    now[0] = 9.0
    assert kept.get("a", "msg_1") is not None  # refreshed: due at 19
    now[0] = 18.0
    assert kept.get("a", "msg_1") is not None
    now[0] = 40.0
    assert kept.get("a", "msg_1") is None


def test_a_tenant_keeps_at_most_its_bound_the_least_recently_used_dropped() -> None:
    kept = KeptShapes(max_per_tenant=2)
    shape = KeptShape(shape=_shape(ASK), reusable_tokens=0)
    kept.put("a", "1", shape)
    kept.put("a", "2", shape)
    assert kept.get("a", "1") is not None  # now the most recent
    kept.put("a", "3", shape)
    assert kept.get("a", "2") is None and kept.get("a", "1") is not None


def test_diagnosing_an_unknown_request_says_nothing_more() -> None:
    assert diagnose(None, _shape(ASK), PromptInput(messages=[ASK]), _words,
                    block_tokens=4) == UNKNOWN == Diagnosis(is_known=False)


def test_a_diagnosis_of_appended_turns_names_no_part_and_misses_nothing() -> None:
    kept = KeptShape(shape=_shape(SYSTEM, ASK), reusable_tokens=8)
    assert diagnose(kept, _shape(SYSTEM, ASK, ANSWER), PromptInput(
        messages=[SYSTEM, ASK, ANSWER]), _words, block_tokens=4) == Diagnosis(
        is_known=True, reusable_tokens=8)


def test_a_diagnosis_of_an_edited_message_names_the_block_after_the_shared_turns() -> None:
    kept = KeptShape(shape=_shape(SYSTEM, ASK, ANSWER), reusable_tokens=8)
    prompt = PromptInput(messages=[SYSTEM, ASK, {"role": "assistant", "content": "five"}])
    # shared: the system message (3 words) and the question (3 words)
    assert diagnose(kept, DIGESTS.shape(model="m", prompt=prompt), prompt, _words,
                    block_tokens=4) == Diagnosis(
        is_known=True, where=Divergence("messages", 1), common_tokens=6, first_block=1,
        reusable_tokens=8, missed_tokens=2)


def test_a_diagnosis_of_a_changed_system_prompt_starts_at_block_0() -> None:
    kept = KeptShape(shape=_shape(SYSTEM, ASK), reusable_tokens=8)
    prompt = PromptInput(messages=[{"role": "system", "content": "x"}, ASK])
    found = diagnose(kept, DIGESTS.shape(model="m", prompt=prompt), prompt, _words,
                     block_tokens=4)
    assert (found.where, found.first_block, found.missed_tokens) == (Divergence("system"), 0, 8)


def test_kept_block_digests_name_the_exact_first_block_an_edit_changes() -> None:
    """A system prompt edited in its third block: the parts say "system" (from block 0 at the
    earliest), the blocks' digests say block 2, and the two blocks before it stay readable."""
    earlier = list(range(100, 120))
    edited = [*earlier[:9], 7, *earlier[10:]]
    kept = KeptShape(shape=_shape(SYSTEM, ASK), reusable_tokens=16,
                     blocks=DIGESTS.blocks(earlier, 4))
    prompt = PromptInput(messages=[{"role": "system", "content": "x"}, ASK])
    found = diagnose(kept, DIGESTS.shape(model="m", prompt=prompt), prompt, _words,
                     block_tokens=4, blocks_of=lambda: DIGESTS.blocks(edited, 4))
    assert (found.where, found.first_block, found.missed_tokens) == (Divergence("system"), 2, 8)


def test_block_digests_are_chained_so_equal_digests_mean_an_equal_prefix() -> None:
    a, b = DIGESTS.blocks([1, 2, 3, 4, 5, 6, 7, 8], 4), DIGESTS.blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert first_difference(a, DIGESTS.blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)) == 2


def test_a_diagnosis_without_the_cache_key_ignores_a_changed_key() -> None:
    kept = KeptShape(shape=_shape(SYSTEM, ASK, key="a"), reusable_tokens=8)
    prompt = PromptInput(messages=[SYSTEM, ASK])
    current = _shape(SYSTEM, ASK)
    assert diagnose(kept, current, prompt, _words, block_tokens=4).where == Divergence(
        "prompt_cache_key")
    assert diagnose(kept, current, prompt, _words, block_tokens=4,
                    compare_cache_key=False).where is None
