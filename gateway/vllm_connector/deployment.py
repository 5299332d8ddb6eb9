"""One vLLM deployment's kvgate side: the connector's settings, validated, and what both of its
halves derive from them (the kvgate config and secret, the page layout, the namespaces).

Why one place: the scheduler half and the worker half run in different processes and must
agree on every block key, so both build the same ``ConnectorDeployment`` from the same
``kv_connector_extra_config`` and the same ``kvgate.toml``. Everything a person can get wrong
is checked here, at the edge, and refused in one sentence naming the setting
(``ConnectorRefused``), before vLLM allocates anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.cache.base import TierEvents
from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.config.loader import load_serve_config
from gateway.config.secrets import deployment_secret
from gateway.config.settings import ConfigError, ServeConfig
from gateway.core.fingerprint import Namespace, Scope
from gateway.engine.models.loading import ModelLoadError, ModelSource, fingerprint_source
from gateway.vllm_connector.page_layout import VllmPageLayout
from gateway.vllm_connector.scope_tag import parse_default_scope, scope_key
from tiers.kinds.remote import RedisTierConfig

CONFIG_KEY = "kvgate_config"
"""``kv_connector_extra_config`` entry: the path of this worker's ``kvgate.toml``."""
DEFAULT_SCOPE_KEY = "default_scope"
"""Entry: the scope of requests without a valid gateway tag (``none``, ``shared``,
``tenant:<id>``; default ``none``)."""
FINGERPRINT_KEY = "model_fingerprint"
"""Entry: the model's fingerprint, where vLLM's model is not a local checkpoint directory
(default: the digest of its weight files and config, as ``kvgate serve`` takes it)."""
KNOWN_KEYS = frozenset({CONFIG_KEY, DEFAULT_SCOPE_KEY, FINGERPRINT_KEY})


class ConnectorRefused(ValueError):
    """The connector cannot serve this deployment; the message says what to change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings:
    """The connector's own entries of ``kv_connector_extra_config``."""

    config_path: Path
    default_scope: Scope | None
    model_fingerprint: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> ConnectorSettings:
        """Read the entries whose names start with ``kvgate`` or are ours; others are vLLM's
        or another connector's business.

        Raises:
            ConnectorRefused: an entry is missing or malformed.
        """
        path = extra.get(CONFIG_KEY)
        if not isinstance(path, str) or not path:
            raise ConnectorRefused(
                f"kv_connector_extra_config.{CONFIG_KEY} must name this vLLM worker's "
                "kvgate.toml (its [cache] tiers, with a disk path of its own)")
        scope_text = extra.get(DEFAULT_SCOPE_KEY, "none")
        if not isinstance(scope_text, str):
            raise ConnectorRefused(f"kv_connector_extra_config.{DEFAULT_SCOPE_KEY} must be "
                                   "'none', 'shared' or 'tenant:<id>'")
        try:
            default_scope = parse_default_scope(scope_text)
        except ValueError as exc:
            raise ConnectorRefused(f"kv_connector_extra_config.{DEFAULT_SCOPE_KEY}: {exc}"
                                   ) from None
        fingerprint = extra.get(FINGERPRINT_KEY)
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise ConnectorRefused(f"kv_connector_extra_config.{FINGERPRINT_KEY} must be a "
                                   "non-empty string")
        return cls(config_path=Path(path), default_scope=default_scope,
                   model_fingerprint=fingerprint)


@dataclass(slots=True, kw_only=True)
class ConnectorDeployment:
    """What both halves of the connector know of the deployment.

    Attributes:
        config: the worker's validated kvgate configuration.
        secret: the deployment secret (namespaces, block MACs, scope tags).
        layout: vLLM's page layout.
        model_fingerprint: the model's fingerprint, in every namespace.
        default_scope: the scope of a request without a valid tag (None: not cached).
    """

    config: ServeConfig
    secret: bytes
    layout: VllmPageLayout
    model_fingerprint: str
    default_scope: Scope | None
    _namespaces: dict[Scope, Namespace] = field(default_factory=dict)

    @classmethod
    def open(cls, settings: ConnectorSettings, layout: VllmPageLayout, *, model: str,
             env: Mapping[str, str] | None = None) -> ConnectorDeployment:
        """Load the kvgate config and secret and check them against vLLM's layout.

        Raises:
            ConnectorRefused: the config is invalid, its blocks are not vLLM's pages, it has a
                lossy tier, or the model has no fingerprint.
        """
        env = dict(os.environ) if env is None else env
        if not settings.config_path.is_file():
            raise ConnectorRefused(f"kvgate config {settings.config_path} does not exist "
                                   f"(kv_connector_extra_config.{CONFIG_KEY})")
        try:
            config = load_serve_config(settings.config_path, env=env)
            secret = deployment_secret(config, env)
        except ConfigError as exc:
            raise ConnectorRefused(str(exc)) from None
        problems = layout.problems(config.cache.block_tokens)
        lossy = [tier.kind for tier in config.cache.tiers if tier.lossy_format is not None]
        if lossy:
            problems.append(f"tiers {lossy} keep lossy copies, whose per-token scales would run "
                            "over vLLM's packed pages: set their quantize to 'none'")
        if problems:
            raise ConnectorRefused("kvgate cannot hold this vLLM's pages: " + "; ".join(problems))
        fingerprint = settings.model_fingerprint or _fingerprint(model)
        return cls(config=config, secret=secret, layout=layout, model_fingerprint=fingerprint,
                   default_scope=settings.default_scope)

    @property
    def scope_key(self) -> bytes:
        """The key the gateway tags scopes with."""
        return scope_key(self.secret)

    def namespace_of(self, scope: Scope) -> Namespace:
        """The namespace of ``scope``'s pages (memoised)."""
        namespace = self._namespaces.get(scope)
        if namespace is None:
            namespace = self.layout.namespace(deployment_secret=self.secret,
                                              model_fingerprint=self.model_fingerprint,
                                              scope=scope)
            self._namespaces[scope] = namespace
        return namespace

    def known_namespaces(self) -> list[Namespace]:
        """Every namespace derived so far."""
        return list(self._namespaces.values())

    def disk_roots(self) -> list[Path]:
        """The directories of the worker's disk tiers."""
        paths = (getattr(tier, "path", None) for tier in self.config.cache.tiers
                 if tier.kind == "disk")
        return [Path(path) for path in paths if path is not None]

    def redis_tier(self) -> RedisTierConfig | None:
        """The worker's Redis tier, if it has one."""
        for tier in self.config.cache.tiers:
            if isinstance(tier, RedisTierConfig) and tier.url is not None:
                return tier
        return None

    def open_cache(self, *, running_pages: int, tier_events: TierEvents | None = None
                   ) -> OpenedCache:
        """The worker's cache, its pool with room for ``running_pages`` pages beyond the
        device tier's budget (the pages a save copies before ``insert`` takes them);
        ``tier_events`` hears of every copy a tier gains or loses."""
        layout = self.layout.kv_layout
        page_bytes = layout.block_nbytes(self.layout.block_size)
        return open_cache(self.config.cache, layout=layout, deployment_secret=self.secret,
                          running_bytes=running_pages * page_bytes, tier_events=tier_events)


def _fingerprint(model: str) -> str:
    directory = Path(model)
    if not (directory / "config.json").is_file():
        raise ConnectorRefused(
            f"vLLM's model {model!r} is not a local checkpoint directory, so kvgate cannot take "
            f"its fingerprint: give kv_connector_extra_config.{FINGERPRINT_KEY} (the same for "
            "every replica serving these weights)")
    try:
        return fingerprint_source(ModelSource(directory=directory))
    except ModelLoadError as exc:
        raise ConnectorRefused(str(exc)) from None

