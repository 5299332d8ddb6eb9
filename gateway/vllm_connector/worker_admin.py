"""Operators' evictions reaching a vLLM worker's cache: the Redis eviction stream, followed.

Why the worker follows the stream like any replica: an admin eviction through kvgate (a tenant,
a prompt, a key, everything) must make vLLM miss too, on every worker, also one that was down
when it was published (the stream remembers, and the worker reads on from its cursor beside its
disk tier before it serves: ``gateway.cache.operations.invalidation``). The worker also removes
the copies of its own namespaces in Redis: whoever published the eviction cannot know them --
their device kind is vLLM's page layout -- so without this a second vLLM would load what the
operator evicted. Prompts named by text are tokenised with the checkpoint's own tokenizer, as
the gateway does for the prompts it sends (``PromptKeys``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from pathlib import Path

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import OpenedCache, eviction_cursor_path
from gateway.cache.operations.invalidation import EventBounds, EvictionFeed
from gateway.config.keys import MAX_TENANT_CHARS
from gateway.core.canonical import PromptInput, canonicalize
from gateway.core.errors import InvalidRequest
from gateway.core.fingerprint import Namespace, Scope
from gateway.core.tokenizer import Tokenizer
from gateway.core.tokens import TokenIds
from gateway.engine.models.loading import read_tokenizer
from gateway.vllm_connector.deployment import ConnectorDeployment

logger = logging.getLogger(__name__)

CATCH_UP_S = 10.0
"""How long a starting worker waits to read the evictions published while it was down."""


class WorkerPromptKeys:
    """``PromptKeys`` of a vLLM worker: its deployment's namespaces, its checkpoint's tokenizer
    (read on first use: most evictions name a tenant or a key, not a prompt)."""

    def __init__(self, deployment: ConnectorDeployment, model_dir: Path | None) -> None:
        self._deployment = deployment
        self._model_dir = model_dir
        self._tokenizer: Tokenizer | None = None

    def namespace(self, scope: Scope) -> Namespace:
        return self._deployment.namespace_of(scope)

    def known_namespaces(self) -> list[Namespace]:
        return self._deployment.known_namespaces()

    def prompt_tokens(self, prompt: PromptInput) -> TokenIds:
        return canonicalize(prompt, self._read_tokenizer()).token_ids

    def preview(self, token_ids: Sequence[int]) -> str:
        return self._read_tokenizer().decode(token_ids)

    def _read_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            if self._model_dir is None:
                raise InvalidRequest("this vLLM worker's model is not a local checkpoint: it "
                                     "cannot tokenise a prefix text to evict")
            self._tokenizer, _ = read_tokenizer(self._model_dir)
        return self._tokenizer


def follow_evictions(opened: OpenedCache, deployment: ConnectorDeployment,
                     model_dir: Path | None) -> EvictionFeed | None:
    """Start following the deployment's eviction stream (None without Redis), after reading
    what was published while the worker was down (``CATCH_UP_S`` at most)."""
    if opened.events is None:
        return None
    admin: CacheAdmin | None = None
    feed = EvictionFeed(
        opened.events, lambda event: admin.apply_event(event, remote=True) if admin else None,
        origin=secrets.token_hex(8),
        bounds=EventBounds(max_prefix_chars=deployment.config.limits.max_prompt_chars,
                           max_tenant_chars=MAX_TENANT_CHARS),
        cursor_path=eviction_cursor_path(deployment.config.cache))
    admin = CacheAdmin(opened.cache, keys=WorkerPromptKeys(deployment, model_dir), feed=feed)
    feed.start()
    if not feed.settled.wait(CATCH_UP_S):
        logger.warning("kvgate: serving before the evictions published while this worker was "
                       "down were read: Redis is slow or unreachable (they are applied once it "
                       "answers)")
    return feed
