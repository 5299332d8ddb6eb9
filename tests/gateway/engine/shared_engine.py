"""One engine (and its cache) shared by many parity tests, started again only when a test needs
a prompt's blocks untouched.

Why: every engine start probes invariance on the real weights (about a second on the tiny Llama,
many on SmolLM2), and the parity suites ran one start per test. Tests may share an engine as long
as no test is handed blocks that another test's requests moved: a test that needs a prompt's
blocks exactly where a restart (or another process) left them -- served from disk after a
restart, from Redis -- asks ``untouched(tokens)``, and gets a new engine whenever the current one
has already run a prompt that shares a full block with this one. Every test still checks which
tiers held each block it was served, so a wrongly shared block fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.cache.operations.factory import OpenedCache
from gateway.engine.engine import Engine

StartEngine = Callable[[], tuple[Engine, OpenedCache]]


def share_a_block(a: Sequence[int], b: Sequence[int], block_tokens: int) -> bool:
    """Whether token sequences ``a`` and ``b`` begin with the same full block (and so share its
    key: a block's key chains its parent's)."""
    return len(a) >= block_tokens and list(a[:block_tokens]) == list(b[:block_tokens])


class SharedEngine:
    """Engines from ``start``, one at a time; ``close`` stops the current one.

    Args:
        start: opens a cache and starts an engine over it (over the same directory each time
            where a restart is meant).
        block_tokens: tokens per block.
        on_start: checks each new engine (for instance that it recovered blocks from disk).
    """

    def __init__(self, start: StartEngine, *, block_tokens: int,
                 on_start: Callable[[Engine, OpenedCache], None] | None = None) -> None:
        self._start = start
        self._block_tokens = block_tokens
        self._on_start = on_start
        self._current: tuple[Engine, OpenedCache] | None = None
        self._ran: list[list[int]] = []
        self.num_starts = 0

    def untouched(self, tokens: Sequence[int]) -> tuple[Engine, OpenedCache]:
        """An engine that has run no prompt sharing a full block with ``tokens`` (and is now
        taken to run this one)."""
        if any(share_a_block(tokens, ran, self._block_tokens) for ran in self._ran):
            self.close()
        return self.any(tokens)

    def any(self, tokens: Sequence[int]) -> tuple[Engine, OpenedCache]:
        """The current engine, whatever it has run (started if there is none)."""
        if self._current is None:
            self._current = self._start()
            self.num_starts += 1
            if self._on_start is not None:
                self._on_start(*self._current)
        self._ran.append(list(tokens))
        return self._current

    def close(self) -> None:
        """Stop the current engine and close its cache (the next call starts another)."""
        current, self._current = self._current, None
        self._ran.clear()
        if current is not None:
            engine, opened = current
            engine.stop(grace_s=5)
            opened.close()
