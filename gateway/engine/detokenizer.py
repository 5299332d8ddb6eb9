"""Turning generated token ids into streamed text without splitting characters or stop strings.

Byte-level tokenizers can end a token in the middle of a UTF-8 character; decoding then yields
U+FFFD, which must not be streamed. Stop strings may also straddle tokens. So the text of all
tokens so far is decoded each step and only the part that is final is released: text that ends
in U+FFFD is held back, and so is any tail that could still become the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental detokenizer for one request."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._released = 0  # characters of the text already streamed
        self.stopped = False

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, token_id: int) -> str:
        """Add one token; return the text that is now final (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        for stop in self._stop:
            at = text.find(stop, max(0, self._released - len(stop)))
            if at != -1:
                self.stopped = True
                out = text[self._released : at] if at > self._released else ""
                self._released = max(self._released, at)
                return out
        end = len(text)
        if text.endswith(_REPLACEMENT):
            end = len(text.rstrip(_REPLACEMENT))
        end = min(end, len(text) - self._held_for_stop(text))
        if end <= self._released:
            return ""
        out = text[self._released : end]
        self._released = end
        return out

    def finish(self) -> str:
        """Whatever text is still held back, released at the end of generation."""
        if self.stopped:
            return ""
        text = self._tokenizer.decode(self._ids)
        out = text[self._released :]
        self._released = len(text)
        return out

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held
