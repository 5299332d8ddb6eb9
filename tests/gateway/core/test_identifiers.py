"""Client-made names (tags, session ids): one rule, each kind saying only what differs."""

from __future__ import annotations

import pytest

from gateway.core.errors import InvalidRequest
from gateway.core.identifiers import IdentifierRule
from gateway.core.sessions import checked_session_id, session_id_problem
from gateway.core.tags import checked_tag, tag_problem


def test_a_refusal_says_what_would_have_been_accepted() -> None:
    assert tag_problem("docs v3") == ("the tag 'docs v3' is not a tag: use 1 to 64 letters, "
                                      "digits, '.', '_' or '-' (e.g. docs-v3)")
    assert session_id_problem("chat 1") == ("'chat 1' is not a session id: use 1 to 128 letters, "
                                            "digits, '.', '_', ':', '@' or '-' (e.g. chat-8f2c)")


def test_the_marks_and_the_length_decide() -> None:
    rule = IdentifierRule(noun="label", max_chars=4, marks="-", example="a-1")
    assert rule.problem("a-1") is None and rule.problem("ab-9") is None
    assert rule.problem("a.1") is not None  # a mark it does not name
    assert rule.problem("abcde") is not None and rule.problem("") is not None


def test_a_long_refused_value_is_shown_cut_short() -> None:
    problem = session_id_problem("x" * 200 + " ")
    assert problem is not None and "x" * 40 + "...'" in problem and "x" * 41 not in problem


def test_checking_names_the_field() -> None:
    assert checked_tag("docs-v3") == "docs-v3"
    with pytest.raises(InvalidRequest, match=r"^cache\.session_id: 'a b' is not a session id"):
        checked_session_id("a b", "cache.session_id")
