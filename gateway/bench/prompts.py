"""The prompts of a TTFT run: exact-length prose prefixes and never-repeating suffixes.

Real English prose tokenised with the model's own tokenizer (random token ids prefill at other
speeds than text), cut to exact token counts; every system measured gets the same token ids.
"""

from __future__ import annotations

from gateway.engine.models.loading import LoadedModel

PROSE = (
    "The lighthouse keeper kept a ledger of every ship that passed the headland, noting the "
    "hour, the wind and the colour of the sea. Over forty winters the pages filled with small, "
    "careful handwriting, and a reader who turned them today would find not only the traffic "
    "of a busy coast but the slow story of a man who learned to read weather the way others "
    "read faces.",
    "A river does not carve a valley in a day. Each flood moves a little gravel, each dry "
    "summer lets the banks settle, and the shape we see is the sum of countless ordinary "
    "seasons. Geologists like to say that the present is the key to the past, because the "
    "same quiet forces are still at work under our feet.",
    "When the library reopened after the repairs, the librarians found that readers had "
    "changed their habits. Fewer people came to borrow novels, more came to sit in the warm "
    "reading room with a laptop, and the children's corner was busier than ever on rainy "
    "afternoons. The building was the same; what people needed from it was not.",
    "Bread is a conversation between flour, water, salt and time. A baker who hurries the "
    "dough gets a loaf that looks right and tastes of little, while one who lets it rest "
    "overnight in a cool room is rewarded with a crust that crackles and a crumb full of "
    "irregular holes. Patience, more than any recipe, is the secret ingredient.",
    "The first railway timetables were printed because towns kept their own local time, set "
    "by the sun, and a train that left one station at noon could arrive at the next before it "
    "had departed. Standard time zones were a practical answer to a practical problem, and "
    "they quietly changed how everyone thought about the hours of the day.",
    "In the high meadows the snow lingers until June, and the flowers have only a few weeks "
    "to bloom, be pollinated and set seed before the cold returns. Botanists who study them "
    "describe a race against the calendar in which every warm afternoon matters and a single "
    "late frost can undo a whole year of growth.",
    "A good map leaves things out. The mapmaker decides which roads, rivers and villages a "
    "traveller needs, and draws them clearly, while the thousand details that would only "
    "clutter the page are quietly dropped. The art lies in knowing what the reader is trying "
    "to do and serving that purpose without distraction.",
    "Old sailing ships carried spare canvas, rope and timber, because a storm far from any "
    "harbour could tear a sail or crack a spar, and the crew had to mend what broke with what "
    "they had on board. Seamanship was as much about careful preparation before a voyage as "
    "about courage during it.",
)
"""Paragraphs of plain English prose: the shared prefix is made of these, repeated."""

_SUFFIX_LEADS = (
    "Why", "How", "What", "When", "Where", "Which", "Who", "Explain", "Describe", "Summarise",
    "List", "Compare", "Consider", "Imagine", "Suppose", "Tell", "Give", "Name", "Recall",
    "Discuss", "Outline", "State", "Identify", "Contrast", "Estimate", "Judge", "Predict",
    "Defend", "Question", "Analyse", "Reflect", "Review",
)
_SUFFIX_BODY = (
    " in one short sentence would a careful reader answer the question about the passage "
    "above, considering the details it gives and what it leaves unsaid?"
)



def make_prefix(loaded: LoadedModel, num_tokens: int, tag: str) -> list[int]:
    """Exactly ``num_tokens`` tokens of prose, starting with ``tag``: prompts with different
    tags differ from their first tokens on, so they share no block."""
    text = f"{tag}: reading notes.\n\n"
    section = 0
    ids: list[int] = []
    while len(ids) < num_tokens:
        for paragraph in PROSE:
            section += 1
            text += f"Section {section}. {paragraph}\n\n"
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    return ids[:num_tokens]


class SuffixSource:
    """A fresh ``num_tokens``-token question per request; leading words differ, so that no
    cache (ours or a peer's) can reuse any of one request's suffix for another."""

    def __init__(self, loaded: LoadedModel, num_tokens: int) -> None:
        self._loaded = loaded
        self._num_tokens = num_tokens
        self._count = 0

    def next(self) -> list[int]:
        i = self._count
        self._count += 1
        lead = _SUFFIX_LEADS[i % len(_SUFFIX_LEADS)]
        text = f"{lead}, for the {i + 1}th time,{_SUFFIX_BODY}"
        ids = self._loaded.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < self._num_tokens:
            text += _SUFFIX_BODY
            ids = self._loaded.tokenizer.encode(text, add_special_tokens=False)
        return ids[: self._num_tokens]
