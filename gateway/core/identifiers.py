"""Names a client makes up and sends (a tag, a session id): which characters, how many, and how
a refusal reads. Why one module: each kind is a short run of letters, digits and a few marks,
checked at the edge with a message that says what would have been accepted; the rule is written
once and each kind states only what differs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gateway.core.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class IdentifierRule:
    """One kind of client-made name.

    Attributes:
        noun: what it is called in a refusal ("tag", "session id").
        max_chars: the longest accepted.
        marks: the characters accepted besides ASCII letters and digits.
        example: a valid one, shown in a refusal.
        named: whether a refusal leads with the noun ("the tag 'x' is not a tag") or with the
            value alone ("'x' is not a session id").
    """

    noun: str
    max_chars: int
    marks: str
    example: str
    named: bool = False
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chars = "".join(re.escape(mark) for mark in self.marks)
        object.__setattr__(self, "_pattern",
                           re.compile(rf"[A-Za-z0-9{chars}]{{1,{self.max_chars}}}"))

    def problem(self, text: str) -> str | None:
        """What is wrong with ``text`` as one of these, or None if it is one."""
        if self._pattern.fullmatch(text):
            return None
        shown = repr(text if len(text) <= 40 else text[:40] + "...")
        subject = f"the {self.noun} {shown}" if self.named else shown
        quoted = [repr(mark) for mark in self.marks]
        allowed = ", ".join(quoted[:-1]) + " or " + quoted[-1]
        return (f"{subject} is not a {self.noun}: use 1 to {self.max_chars} letters, digits, "
                f"{allowed} (e.g. {self.example})")

    def checked(self, text: str, field_name: str) -> str:
        """``text`` if it is one of these.

        Raises:
            InvalidRequest: it is not (the message names ``field_name`` and what is accepted).
        """
        problem = self.problem(text)
        if problem is not None:
            raise InvalidRequest(f"{field_name}: {problem}")
        return text
