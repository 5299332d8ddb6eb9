"""Turning generated token ids into streamed text without splitting characters or stop strings.

Byte-level tokenizers can end a token in the middle of a UTF-8 character; decoding then yields
U+FFFD, which must not be streamed. Stop strings may also straddle tokens. So only the part of
the text that is final is released: text that ends in U+FFFD is held back, and so is any tail
that could still become the start of a stop string.

Decoding is incremental, as vLLM's detokenizer does it: re-decoding every token of the answer at
each step made a token's cost grow with the answer's length (14.5x at 8,192 tokens than at 512,
issue 22). Two offsets split the ids: ``ids[prefix:read]`` is the last stretch already turned
into text, kept as context, and ``ids[read:]`` the tokens whose text is not final yet. Each step
decodes only ``ids[prefix:]``; the new text is what that decodes to beyond the text of
``ids[prefix:read]``. The context is needed because a token's text can depend on its
neighbours: a decoder may strip the leading space of the first token it is given (SentencePiece's
``Strip``), or join byte-fallback tokens (``<0xE2>``) into one character. When the text no longer
ends in U+FFFD the pending tokens are final and the offsets move on.

NOTE: a run of tokens that never completes a character (a model emitting stray bytes) would
keep ``ids[read:]`` growing. After ``MAX_PENDING_TOKENS`` the text of all but the last
``_SETTLE_TOKENS`` of them is taken as final if more tokens left it unchanged: UTF-8 settles a
partial character within three more bytes. So the ids decoded per step stay bounded.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"

MAX_PENDING_TOKENS = 16
"""Tokens whose text may stay unsettled (ending in U+FFFD) before part of it is taken as final."""
_MAX_CONTEXT_TOKENS = 4 * MAX_PENDING_TOKENS
"""Tokens of context kept at most (more only where a decoder rewrites text that far back)."""
_SETTLE_TOKENS = 4
"""Tokens after a stretch that must leave its text unchanged for it to be final (a UTF-8
character is at most four bytes)."""


class Detokenizer:
    """Incremental detokenizer for one request.

    Each ``add`` decodes at most ``16 * MAX_PENDING_TOKENS`` ids (in the worst case; a few in the
    common one), however long the answer.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._lookbehind = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix:read]: context, its text already final
        self._read_offset = 0  # ids[read:]: tokens whose text is not final yet
        self._prefix_text = ""  # text of ids[prefix:read], decoded alone
        self._pending = ""  # the text that ids[read:] adds to it (may end in U+FFFD)
        self._final = ""  # final text, from character _final_start of the answer on
        self._final_start = 0
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
        self._decode_pending()
        text = self._final + self._pending  # the answer's text from _final_start on
        released = self._released - self._final_start
        for stop in self._stop:
            at = text.find(stop, max(0, released - len(stop)))
            if at != -1:
                self.stopped = True
                out = text[released:at] if at > released else ""
                self._released = max(self._released, self._final_start + at)
                return out
        end = len(text)
        if text.endswith(_REPLACEMENT):
            end = len(text.rstrip(_REPLACEMENT))
        end = min(end, len(text) - self._held_for_stop(text))
        if end <= released:
            return ""
        out = text[released:end]
        self._released = self._final_start + end
        self._forget_released()
        return out

    def finish(self) -> str:
        """Whatever text is still held back, released at the end of generation."""
        if self.stopped:
            return ""
        text = self._final + self._pending
        out = text[self._released - self._final_start :]
        self._released = self._final_start + len(text)
        return out

    def _decode_pending(self) -> None:
        """Decode the tokens not yet final, with their context; settle them where possible."""
        new_text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        num_pending = len(self._ids) - self._read_offset
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._settle(len(self._ids), new_text)
            self._pending = ""
            return
        self._pending = new_text[len(self._prefix_text) :]
        if num_pending <= MAX_PENDING_TOKENS:
            return
        cut = len(self._ids) - _SETTLE_TOKENS
        settled = self._tokenizer.decode(self._ids[self._prefix_offset : cut])
        # NOTE: a text that more tokens keep changing is forced final at twice the limit: a
        # decoder that rewrites text that far back cannot be streamed, and cost stays bounded.
        if new_text.startswith(settled) or num_pending > 2 * MAX_PENDING_TOKENS:
            self._settle(cut, settled, is_forced=True)
            self._pending = new_text[len(settled) :]

    def _settle(self, read_offset: int, window_text: str, *, is_forced: bool = False) -> None:
        """Take the text of ``ids[read:read_offset]`` as final and move the offsets.

        Args:
            read_offset: the new read offset.
            window_text: the text of ``ids[prefix:read_offset]``.
            is_forced: the text still ends in U+FFFD (``MAX_PENDING_TOKENS`` passed).
        """
        self._final += window_text[len(self._prefix_text) :]
        context = self._tokenizer.decode(self._ids[self._read_offset : read_offset])
        # NOTE: the settled tokens become the context only where their text alone is their
        # text in context, and not while the text ends in U+FFFD: a ByteFallback decoder
        # (Llama 2's) decodes a run of byte tokens as a whole, all of it U+FFFD if one byte is
        # invalid, so the run's tail alone can read as characters. The context then grows
        # with the run, up to a bound past which such a run's text may differ from a full
        # decode's (by how many U+FFFDs it shows).
        is_own_context = not is_forced and window_text.endswith(context)
        if is_own_context or read_offset - self._prefix_offset > _MAX_CONTEXT_TOKENS:
            self._prefix_offset, self._prefix_text = self._read_offset, context
        else:
            self._prefix_text = window_text
        self._read_offset = read_offset

    def _forget_released(self) -> None:
        """Drop released text that no stop string can straddle any more (keeps memory bounded)."""
        keep_from = max(self._final_start, self._released - self._lookbehind)
        drop = min(keep_from - self._final_start, len(self._final))
        if drop > 0:
            self._final = self._final[drop:]
            self._final_start += drop

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held
