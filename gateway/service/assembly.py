"""The composition root: ``kvgate serve`` built from one ``ServeConfig``, and run.

Everything the gateway is made of is wired here and nowhere else (the one composition root,
docs/contributing.md, "Conventions"): the deployment secret and API keys, the gRPC server, the
OpenAI-compatible HTTP front (``[http]``), the model, the cache layer (stores, policies and prefix
cache, through ``gateway.cache.operations.factory.open_cache``), the metrics endpoint, the
engine, and the cache's admin operations that the Admin service calls. Each gets what it needs
through its constructor; nothing below reaches for a global. The two servers share one
``EngineSlot``, one ``Authenticator`` and the same limits, so they serve one engine, one cache and
one set of metrics: a prefix warmed over gRPC is a hit over HTTP.

Start order: the servers listen first (gRPC health NOT_SERVING, HTTP ``/health`` 503, so an
orchestrator sees the process come up), then the model loads, the cache opens (the Prometheus
endpoint, ``[metrics]``, comes up with it; the API port's ``GET /metrics`` serves from the
start) and the engine starts; then the engine is attached and
both say SERVING. Shutdown order (SIGTERM): health NOT_SERVING; both servers stop taking calls
(new ones fail UNAVAILABLE / 503, so clients retry elsewhere) while calls in flight go on; the
engine finishes or cancels them within the grace period; the metrics endpoint stops; the cache
flushes pending disk writes and closes.
Once the engine's worker has ended (never before: it may still be writing) the cache closes.
The KV-events publisher for routers (``[events]``, off by default) binds just before the cache
opens, so that it hears every block the cache holds, and closes after it.
If the worker thread dies while serving, health turns NOT_SERVING at once
(``gateway.service.watchdog``) and ``serve`` shuts down and raises ``ServeError``, so that
``kvgate serve`` exits non-zero and its supervisor (systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.config.secrets import (
    DEV_ADMIN,
    DEV_TENANT,
    deployment_secret,
    dev_admin_entry,
    dev_admin_key,
    dev_api_key,
    dev_key_entry,
    ensure_private_dir,
)
from gateway.config.settings import ServeConfig
from gateway.core.addresses import is_loopback
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.prompt_comparisons import PromptComparisons
from gateway.service.scrape_token import scrape_token_of
from gateway.service.server import GatewayServer, ServeError, check_plaintext_listener
from gateway.service.startup import stage

if TYPE_CHECKING:
    import torch

    from gateway.cache.operations.admin import CacheAdmin
    from gateway.cache.operations.factory import OpenedCache
    from gateway.cache.operations.invalidation import EvictionFeed
    from gateway.cache.prefix_cache import PrefixCache
    from gateway.engine.engine import Engine
    from gateway.engine.models.loading import LoadedModel
    from gateway.service.admission import Admission
    from gateway.service.http.server import HttpFront
    from gateway.service.kv_events.publisher import KVEventPublisher
    from gateway.service.metrics import GatewayMetrics
    from gateway.service.stats_log import StatsLine
    from policies.base import BlockKey

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.25
"""How often ``serve`` looks whether it must stop (a signal, or a dead engine worker)."""
_CATCH_UP_S = 10.0
"""The longest a starting replica waits to apply the evictions it missed before it serves."""
EVICTIONS_HEALTH = "kvgate.evictions"
"""The gRPC health service that says whether this replica hears other replicas' evictions
(NOT_SERVING while it is behind; the gateway's own health stays SERVING: it serves correctly
from what it holds, an operator is told that evictions may not reach it)."""
FEED_QUIET_S = 30.0
"""A feed that has not read the stream for this long is behind (its reads block ~1 s)."""


def build_authenticator(
    config: ServeConfig, announce: Callable[[str], None], *, announces_to_terminal: bool = False
) -> Authenticator:
    """The configured keys; with none, the development key of tenant ``default`` and the
    development admin key (their paths announced).

    Development mode (no key configured) is for one machine: it is refused when a listener that
    takes the key (gRPC, or the HTTP front when enabled) is not loopback. The development key
    itself is announced only to a terminal; anywhere else (a log collector, a file) only the
    path of the file that holds it.

    Raises:
        ServeError: no key is configured and a listener is not loopback.
        ConfigError: the development key file is unusable or open to other users.
    """
    if config.keys:
        return Authenticator(config.keys)
    remote = [(name, host) for name, host, is_on in (
        ("gRPC", config.host, True),
        ("the HTTP front ([http] host)", config.http.host, config.http.enabled),
    ) if is_on and not is_loopback(host)]
    if remote:
        name, host = remote[0]
        raise ServeError(
            f"no API keys are configured, and development mode (one generated key) listens "
            f"on loopback only, not on {host} ({name}): configure keys ([[api_keys]] in the "
            "config, or KVGATE_API_KEYS) or listen on 127.0.0.1"
            + ("" if name == "gRPC" else ", or set [http] enabled = false"))
    key = dev_api_key(config)
    admin_key = dev_admin_key(config)
    admin_line = (f"development admin key ({DEV_ADMIN!r}) in {config.dev_admin_key_path} "
                  "(`kvgate admin` on this machine uses it)")
    if announces_to_terminal:
        announce(
            f"no API keys configured: development key for tenant {DEV_TENANT!r}: {key}\n"
            f"(saved in {config.dev_key_path}; `kvgate generate` on this machine uses it); "
            f"{admin_line}"
        )
    else:
        announce(
            f"no API keys configured: the development key for tenant {DEV_TENANT!r} is in "
            f"{config.dev_key_path} (not printed: the output is not a terminal; "
            f"`kvgate generate` on this machine uses it); {admin_line}"
        )
    return Authenticator([dev_key_entry(key), dev_admin_entry(admin_key)])


def _watch_feed(feed: EvictionFeed, server: GatewayServer, was_behind: str | None) -> str | None:
    """Set the ``EVICTIONS_HEALTH`` service from the feed's state; log each change."""
    behind = feed.behind_reason(FEED_QUIET_S)
    if (behind is None) != (was_behind is None):
        server.set_health(EVICTIONS_HEALTH, serving=behind is None)
        if behind is None:
            logger.info("the eviction stream is read again: other replicas' evictions reach "
                        "this one")
        else:
            logger.warning("%s: other replicas' evictions may not reach this one (gRPC health "
                           "%s: NOT_SERVING)", behind, EVICTIONS_HEALTH)
    return behind


def start_metrics(config: ServeConfig, metrics: GatewayMetrics, cache: PrefixCache, *,
                  device: str, dtype: str) -> None:
    """Add the series of ``cache`` and of what the engine runs on (``device`` and ``dtype``,
    resolved: ``cuda:0``, ``bfloat16``) to ``metrics``, and serve every series on
    ``config.metrics``' address if ``[metrics]`` is enabled.

    Raises:
        ServeError: the address cannot be bound.
    """
    metrics.watch_cache(cache.stats)
    metrics.set_engine_info(device=device, dtype=dtype)
    settings = config.metrics
    if not settings.enabled:
        return
    try:
        port = metrics.start(settings.host, settings.port,
                             scrape_token=scrape_token_of(settings))
    except OSError as exc:
        raise ServeError(f"cannot serve metrics on {settings.host}:{settings.port} ({exc}); "
                         "is another process using the port?") from exc
    if not is_loopback(settings.host) and settings.scrape_token_digest is None:
        logger.warning("the metrics endpoint on %s has no authentication and shows per-tenant "
                       "counters: let only your scraper reach it, or set [metrics] "
                       "scrape_token_file", settings.host)
    logger.info("metrics on http://%s:%d/metrics", settings.host, port)


def watch_router(config: ServeConfig, metrics: GatewayMetrics, engine: Engine,
                 cache: PrefixCache, *, block_nbytes: int) -> None:
    """Add the series routers read under vLLM's names (``gateway.service.router_metrics``) for
    a started ``engine`` over ``cache``, whose blocks are ``block_nbytes`` each."""
    from gateway.service.http.app import served_model_names
    from gateway.service.router_metrics import CacheConfigInfo

    metrics.watch_router(
        model_name=served_model_names(engine.model_name, config.http.served_model_name)[0],
        num_running=lambda: engine.num_running, kv_usage=lambda: engine.kv_usage,
        info=CacheConfigInfo.of(cache.stats(), block_tokens=config.cache.block_tokens,
                                block_nbytes=block_nbytes, dtype=engine.dtype))


def start_http(config: ServeConfig, authenticator: Authenticator,
               engines: EngineSlot, admission: Admission | None = None,
               metrics: GatewayMetrics | None = None,
               deployment_secret: bytes | None = None,
               comparisons: PromptComparisons | None = None) -> HttpFront | None:
    """The OpenAI-compatible HTTP front, listening (None when ``[http]`` is off).

    Raises:
        ServeError: it cannot listen as configured.
    """
    if not config.http.enabled:
        return None
    from gateway.service.http.server import HttpFront

    http = HttpFront(config, authenticator, engines, admission,
                     metrics=metrics.public_registry if metrics is not None else None,
                     deployment_secret=deployment_secret, comparisons=comparisons)
    http.start()
    if metrics is not None:
        metrics.watch_accept_errors(http.num_accept_errors)
    logger.info("OpenAI-compatible HTTP on %s (503 until the model has loaded)", http.url)
    return http


@dataclass(frozen=True, slots=True, kw_only=True)
class _Fronts:
    """What listens before the model loads, and what the listeners share."""

    authenticator: Authenticator
    server: GatewayServer
    http: HttpFront | None
    metrics: GatewayMetrics
    stats: StatsLine | None


@dataclass(slots=True, kw_only=True)
class _Opened:
    """What the start-up stages have opened so far (None: not yet), for ``_shut_down``."""

    kv_events: KVEventPublisher | None = None
    cache: OpenedCache | None = None
    engine: Engine | None = None
    feed: EvictionFeed | None = None
    admin: CacheAdmin | None = None


def serve(
    config: ServeConfig,
    *,
    env: Mapping[str, str],
    stop_requested: threading.Event,
    announce: Callable[[str], None],
    announces_to_terminal: bool = False,
    serving: threading.Event | None = None,
) -> None:
    """Run the gateway until ``stop_requested`` is set, then shut down gracefully.

    The stages, in order: the fronts listen (``_start_fronts``), the model loads
    (``_load_model``), the cache opens (``_open_cache``, then its metrics), the engine chooses
    its route and starts (``_start_engine``), the cache's admin catches up with the other
    replicas' evictions (``_open_admin``), the gateway serves until told to stop
    (``_serve_until_stopped``), and everything opened is closed in order (``_shut_down``).
    Each start-up stage is logged with its duration (``gateway.service.startup.stage``); a
    signal before serving raises ``StartInterrupted`` out of whichever is running, and the
    engine's route search polls ``stop_requested`` itself.

    Args:
        config: the validated configuration.
        env: the environment (for ``KVGATE_DEPLOYMENT_SECRET``).
        stop_requested: set by the signal handler (SIGTERM, SIGINT).
        announce: writes a line for the operator's console (the development key).
        announces_to_terminal: ``announce`` writes to a terminal (else the development key is
            not written, only the path of its file).
        serving: set once the gateway serves (the signal handler stops interrupting then).

    Raises:
        ServeError, gateway.config.settings.ConfigError,
        gateway.engine.models.loading.ModelLoadError:
            it could not start.
    """
    ensure_private_dir(config.data_dir)
    secret = deployment_secret(config, env)
    fronts = _start_fronts(config, announce, announces_to_terminal=announces_to_terminal,
                           secret=secret)
    logger.info("listening on %s:%d; loading the model %s", config.host, fronts.server.port,
                config.model)
    opened = _Opened()
    try:
        loaded, device, dtype = _load_model(config)
        cache = _open_cache(config, opened, loaded, device=device, secret=secret)
        start_metrics(config, fronts.metrics, cache.cache, device=str(device),
                      dtype=str(dtype).removeprefix("torch."))
        engine = _start_engine(config, opened, fronts.metrics, loaded, cache, secret=secret,
                               stop_requested=stop_requested)
        admin = _open_admin(config, opened, fronts.metrics, cache, engine)
        if not stop_requested.is_set():
            _serve_until_stopped(config, fronts, engine, admin, opened.feed,
                                 tier_names=cache.cache.tier_names, device=str(device),
                                 stop_requested=stop_requested, serving=serving,
                                 announce=announce)
        logger.info("shutting down: finishing requests in flight (grace %.0f s)",
                    config.grpc.shutdown_grace_s)
    finally:
        _shut_down(config, fronts, opened)


def _start_fronts(config: ServeConfig, announce: Callable[[str], None], *,
                  announces_to_terminal: bool, secret: bytes | None = None) -> _Fronts:
    """The gRPC server and the HTTP front, listening and answering health (NOT_SERVING, 503)
    until an engine is attached; the metrics that both serve from the start.

    Raises:
        ServeError: a listener cannot listen as configured, or has no keys it may use.
    """
    # NOTE: the listener's transport is judged before its keys, so a remote plaintext
    # listener hears about TLS first (the keys would not help it).
    check_plaintext_listener(config, config.host, config.address)
    authenticator = build_authenticator(config, announce,
                                        announces_to_terminal=announces_to_terminal)
    engines = EngineSlot()
    # One for both surfaces: a Lookup may name an id the HTTP front kept, and the other way.
    comparisons = PromptComparisons(block_tokens=config.cache.block_tokens)
    server = GatewayServer(config, authenticator, engines=engines, comparisons=comparisons)
    server.start()
    if server.admin_port is not None:
        logger.info("the Admin service listens on its own, on %s:%d", config.admin_host,
                    server.admin_port)
    from gateway.service.metrics import GatewayMetrics
    from gateway.service.stats_log import StatsLine

    # NOTE: before the HTTP front, whose GET /metrics serves it from the start.
    metrics = GatewayMetrics(kv_budget_bytes=config.engine.kv_budget_bytes)
    stats = (StatsLine(metrics.totals, interval_s=config.logging.stats_interval_s,
                       is_json=config.logging.json) if config.logging.stats_interval_s else None)
    try:
        http = start_http(config, authenticator, engines, server.admission, metrics,
                          deployment_secret=secret, comparisons=comparisons)
    except BaseException:
        server.stop(0)
        raise
    return _Fronts(authenticator=authenticator, server=server, http=http, metrics=metrics,
                   stats=stats)


def _load_model(config: ServeConfig) -> tuple[LoadedModel, torch.device, torch.dtype]:
    """The model, on the device and in the dtype the config resolves to.

    Raises:
        ServeError: the device or dtype cannot be used here.
        gateway.engine.models.loading.ModelLoadError: the model cannot be loaded.
    """
    # NOTE: imported once listening, so that health answers (NOT_SERVING) during the import.
    from gateway.config.device import DeviceError, resolve_device
    from gateway.config.dtype import DtypeError, resolve_dtype
    from gateway.engine.models.loading import load_model

    try:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
    except (DeviceError, DtypeError) as exc:
        raise ServeError(str(exc)) from None
    with stage(f"loading the model {config.model} ({device}, "
               f"{str(dtype).removeprefix('torch.')})"):
        loaded = load_model(config.model, cache_dir=config.data_dir / "models",
                            device=device, dtype=dtype, block_tokens=config.cache.block_tokens)
    refuse_lossy_states(config, loaded)
    return loaded, device, dtype


def refuse_lossy_states(config: ServeConfig, loaded: LoadedModel) -> None:
    """Refuse lossy tiers for a model whose recurrent states its blocks keep: a lossy format
    would quantize the states' bytes with the K/V, and a warm start would resume from numbers
    no layer computed -- not an approximation of the answer, another one.

    Raises:
        UnservableModel: in one line, naming the setting to change.
    """
    from gateway.cache.lossy_tiers import lossy_tiers
    from gateway.engine.models.loading import UnservableModel

    lossy = lossy_tiers(config.cache.quantize)
    if loaded.keeps_states and lossy:
        named = ", ".join(f"{tier} = {fmt}" for tier, fmt in sorted(lossy.items()))
        raise UnservableModel(
            f"cannot serve {loaded.name} exactly with lossy tiers ({named}): its recurrent "
            "layers' states are kept in its blocks, and a lossy format would change them; set "
            "those tiers to \"none\" in [cache] quantize")


def _open_cache(config: ServeConfig, opened: _Opened, loaded: LoadedModel, *,
                device: torch.device, secret: bytes) -> OpenedCache:
    """The cache tiers, open (the disk tier's index recovered), and the KV-events publisher
    (bound first, so that it hears every block the cache holds); both kept in ``opened``."""
    from gateway.cache.load_bandwidth import measure_load_bandwidths
    from gateway.cache.operations.factory import has_tier_to_measure, open_cache
    from gateway.engine.kv.sequence import pool_bytes_for
    from gateway.service.kv_events.publisher import open_kv_events

    with stage("opening the cache tiers (recovering the disk tier's index)"):
        opened.kv_events = open_kv_events(config.events)  # None unless [events] names one
        opened.cache = open_cache(config.cache, layout=loaded.layout, deployment_secret=secret,
                                  device=device, running_bytes=pool_bytes_for(
                                      config.engine.kv_budget_bytes
                                      + config.engine.tail_cache_bytes),
                                  tier_events=opened.kv_events)
    if has_tier_to_measure(config.cache):
        with stage("measuring the load bandwidth of the disk tier and Redis"):
            for result in measure_load_bandwidths(
                    opened.cache.hierarchy, loaded.layout, into_tier="device",
                    block_tokens=config.cache.block_tokens):
                logger.info("load bandwidth before serving: %s", result.describe())
    return opened.cache


def _start_engine(config: ServeConfig, opened: _Opened, metrics: GatewayMetrics,
                  loaded: LoadedModel, cache: OpenedCache, *, secret: bytes,
                  stop_requested: threading.Event) -> Engine:
    """The engine over ``cache``, its route chosen and its worker started (kept in ``opened``
    first, so that a failed start still stops it), and the router series that read it."""
    from gateway.cache.operations.factory import has_tier_to_measure
    from gateway.engine.engine import Engine, EngineConfig
    from gateway.engine.parity.verdicts import VerdictStore

    def evict_everywhere(keys: Sequence[BlockKey]) -> None:
        # A block shadow verification found divergent leaves every tier and every replica
        # (``admin`` exists before the engine serves anything that could be verified).
        admin = opened.admin
        assert admin is not None, "shadow verification before the cache's admin exists"
        for key in keys:
            admin.evict(key_hex=key.hex())

    opened.engine = engine = Engine(
        loaded=loaded,
        cache=cache.cache,
        # The [engine] section as it is, with the block size and deadline cap of their own
        # sections ([cache], [grpc]), so that the places that need them cannot disagree.
        config=EngineConfig.of(config.engine, block_tokens=config.cache.block_tokens,
                               max_deadline_s=config.grpc.max_deadline_s,
                               device_type=loaded.device.type,
                               measure_recompute_at_start=has_tier_to_measure(config.cache)),
        deployment_secret=secret,
        metrics=metrics,
        verdicts=VerdictStore(config.data_dir / "routes", secret),
        cancelled=stop_requested.is_set,
        shadow_evict=evict_everywhere,
        pool=cache.pool,
    )
    with stage("choosing the engine route (remembered, or searched and probed)"):
        engine.start()
    watch_router(config, metrics, engine, cache.cache,
                 block_nbytes=loaded.layout.block_nbytes(config.cache.block_tokens))
    return engine


def _open_admin(config: ServeConfig, opened: _Opened, metrics: GatewayMetrics,
                cache: OpenedCache, engine: Engine) -> CacheAdmin:
    """The cache's admin operations (the Admin service's), and with ``[cache]`` events the feed
    of other replicas' evictions, read up to now (for ``_CATCH_UP_S`` at most)."""
    from gateway.cache.operations.admin import CacheAdmin
    from gateway.cache.operations.factory import eviction_cursor_path
    from gateway.cache.operations.invalidation import EventBounds, EvictionFeed
    from gateway.config.keys import MAX_TENANT_CHARS

    admin: CacheAdmin
    feed: EvictionFeed | None = None
    if cache.events is not None:
        # Evictions through other replicas reach this one's tiers (and those it missed
        # while down are applied before it serves).
        opened.feed = feed = EvictionFeed(cache.events, lambda event: admin.apply_event(event),
                                          origin=secrets.token_hex(8),
                                          # An event's prefix text is bounded like a prompt.
                                          bounds=EventBounds(
                                              max_prefix_chars=config.limits.max_prompt_chars,
                                              max_tenant_chars=MAX_TENANT_CHARS),
                                          cursor_path=eviction_cursor_path(config.cache))
    opened.admin = admin = CacheAdmin(cache.cache, keys=engine, feed=feed)
    if feed is not None:
        feed.start()
        metrics.watch_feed(feed)
        with stage("reading the evictions of other replicas"):
            feed.settled.wait(_CATCH_UP_S)
        if not feed.caught_up.is_set():
            logger.warning("serving before the evictions of other replicas were read: "
                           "Redis is slow or unreachable (they are applied once it is back)")
    return admin


def _serve_until_stopped(config: ServeConfig, fronts: _Fronts, engine: Engine, admin: CacheAdmin,
                         feed: EvictionFeed | None, *, tier_names: Sequence[str], device: str,
                         stop_requested: threading.Event, serving: threading.Event | None,
                         announce: Callable[[str], None]) -> None:
    """Attach the engine (health SERVING), say so, and watch until ``stop_requested``: the
    eviction feed's health, the stats line, and the engine's worker.

    Raises:
        ServeError: the engine's worker thread died.
    """
    server, http = fronts.server, fronts.http
    if serving is not None:
        serving.set()
    server.attach(engine, admin)
    feed_behind: str | None = None
    if feed is not None:
        feed_behind = feed.behind_reason(FEED_QUIET_S)
        server.set_health(EVICTIONS_HEALTH, serving=feed_behind is None)
    logger.info(
        "kvgate SERVING kvgate.v1 on %s:%d%s (%s, model %s on %s in %s, tiers %s, %d API "
        "key(s), engine route %s: %s)",
        config.host, server.port,
        f" and the OpenAI API on {http.url}" if http is not None else "",
        "TLS" if config.uses_tls else "plaintext",
        engine.model_name, device, engine.dtype, "+".join(tier_names),
        fronts.authenticator.num_keys, engine.route.name, engine.route.reason,
    )
    announce(f"gRPC kvgate.v1 on {config.host}:{server.port}"
             + (f"; OpenAI-compatible HTTP on {http.url}" if http is not None else
                " (the HTTP front is off: [http] enabled = false)"))
    while not stop_requested.wait(_WATCH_INTERVAL_S):
        if feed is not None:
            feed_behind = _watch_feed(feed, server, feed_behind)
        if fronts.stats is not None:
            fronts.stats.tick()
        if server.engine_died.is_set():
            raise ServeError("the engine's worker thread died (see the error logged "
                             "above); exiting so that a supervisor restarts the gateway")


def _shut_down(config: ServeConfig, fronts: _Fronts, opened: _Opened) -> None:
    """Stop what started, in order: health NOT_SERVING and no new calls; the engine finishes
    or cancels the calls in flight within the grace period; the listeners and the metrics
    endpoint stop; the feed stops; the cache closes once the engine's worker has ended (never
    before: it may still be writing); the KV-events publisher closes last."""
    server, http, engine = fronts.server, fronts.http, opened.engine
    stopped = server.begin_shutdown()
    if http is not None:
        http.begin_shutdown()
    is_worker_stopped = engine is None or engine.stop(config.grpc.shutdown_grace_s)
    stopped.wait(config.grpc.shutdown_grace_s + 1.0)
    server.stop(0)
    if http is not None:
        http.stop(config.grpc.shutdown_grace_s + 1.0)
    fronts.metrics.stop()  # its own port's, if served
    if opened.feed is not None:
        opened.feed.stop()
    if opened.cache is not None:
        if is_worker_stopped:
            opened.cache.close()
        else:
            logger.error("the engine's worker did not stop: the stores are left open "
                         "(closing them under it could lose or corrupt a write)")
    if opened.kv_events is not None:
        opened.kv_events.close()
    logger.info("stopped")
