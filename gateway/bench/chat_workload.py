"""The conversations of ``kvgate bench load``: many users chatting under one system prompt.

Every user gets the same system prompt -- a support assistant's numbered rules (60 by default,
1,614 tokens with SmolLM2's tokenizer), real English built deterministically from a few lists
-- then asks a short question of their own each round; the answer each system gave is appended
before the next question, as a chat client does. Nothing is random: every system measured gets
the same system prompt and the same questions (the answers are each system's own).
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_RULES = 60

_SHOP = ("You are the support assistant of Northwind Outfitters, a shop that sells outdoor "
         "clothing, boots and camping gear online and in twelve stores. Follow every one of "
         "the numbered rules below in every answer you give.")

_TOPICS = (
    "billing", "account security", "late deliveries", "returns", "faulty products",
    "privacy requests", "price changes", "warranty claims", "accessibility needs",
    "complaints about staff", "large orders", "cancelled subscriptions",
)

_STANCES = (
    "When a customer asks about {topic}, answer in plain language first and add the details "
    "only if they ask for them.",
    "Never promise a particular outcome for {topic}; explain the usual steps and how long each "
    "one normally takes.",
    "For {topic}, read what the customer has already told you before you ask them for anything "
    "a second time.",
    "If you are unsure about {topic}, say so honestly and offer to pass the question to a human "
    "colleague.",
    "Keep answers about {topic} short, polite and free of internal jargon, and end them with one "
    "clear next step.",
)

_QUESTIONS = (
    "In one sentence, what does rule {rule} ask of you?",
    "Why do you think rule {rule} matters to a customer?",
    "Give me a short example of following rule {rule}.",
    "How would rule {rule} change your answer to someone who is upset?",
    "Is there any situation in which rule {rule} does not apply?",
)


def system_prompt(num_rules: int = DEFAULT_RULES) -> str:
    """The shared system prompt: an introduction and ``num_rules`` numbered rules.

    Raises:
        ValueError: ``num_rules`` is not positive.
    """
    if num_rules < 1:
        raise ValueError(f"the system prompt needs at least one rule, got {num_rules}")
    lines = [_SHOP, ""]
    for i in range(num_rules):
        topic = _TOPICS[(i // len(_STANCES)) % len(_TOPICS)]
        stance = _STANCES[i % len(_STANCES)]
        lines.append(f"{i + 1}. {stance.format(topic=topic)}")
    return "\n".join(lines)


def question(user: int, round_index: int, num_rules: int = DEFAULT_RULES) -> str:
    """User ``user``'s question in round ``round_index``: distinct per user, so that users share
    the system prompt and nothing after it."""
    rule = (user * 7 + round_index * 13) % num_rules + 1
    template = _QUESTIONS[(user + round_index) % len(_QUESTIONS)]
    return f"I am customer {user + 1}. " + template.format(rule=rule)


class Conversation:
    """One user's chat: the messages to send this round, and the answer to append."""

    def __init__(self, *, user: int, system: str, num_rules: int) -> None:
        self._user = user
        self._num_rules = num_rules
        self._messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self._round = 0

    @property
    def user(self) -> int:
        return self._user

    def next_messages(self) -> Sequence[dict[str, str]]:
        """The conversation so far plus this round's question."""
        self._messages.append({"role": "user", "content": question(
            self._user, self._round, self._num_rules)})
        return list(self._messages)

    def answered(self, text: str) -> None:
        """Append the answer to the question ``next_messages`` asked."""
        self._messages.append({"role": "assistant", "content": text})
        self._round += 1
