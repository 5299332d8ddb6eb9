"""The composition root: ``kvgate serve`` built from one ``ServeConfig``, and run.

Everything the gateway is made of is wired here and nowhere else (the one composition root,
docs/contributing.md, "Conventions"): the deployment secret and API keys, the gRPC server, the
OpenAI-compatible HTTP front (``[http]``), the model, the cache layer (stores, policies and prefix
cache, through ``gateway.cache.factory.open_cache``), the metrics endpoint, the engine, and the
cache's admin operations that the Admin service calls. Each gets what it needs through its
constructor; nothing below reaches for a global. The two servers share one ``EngineSlot``, one
``Authenticator`` and the same limits, so they serve one engine, one cache and one set of metrics: a
prefix warmed over gRPC is a hit over HTTP.

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
from typing import TYPE_CHECKING, cast

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
from gateway.service.server import GatewayServer, ServeError, check_plaintext_listener
from gateway.service.startup import stage

if TYPE_CHECKING:
    from gateway.cache.invalidation import EvictionFeed
    from gateway.cache.prefix_cache import PrefixCache
    from gateway.engine.engine import Engine
    from gateway.service.admission import Admission
    from gateway.service.http.server import HttpFront
    from gateway.service.metrics import GatewayMetrics
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
        port = metrics.start(settings.host, settings.port)
    except OSError as exc:
        raise ServeError(f"cannot serve metrics on {settings.host}:{settings.port} ({exc}); "
                         "is another process using the port?") from exc
    if not is_loopback(settings.host):
        logger.warning("the metrics endpoint on %s has no authentication and shows per-tenant "
                       "counters: let only your scraper reach it", settings.host)
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
               metrics: GatewayMetrics | None = None) -> HttpFront | None:
    """The OpenAI-compatible HTTP front, listening (None when ``[http]`` is off).

    Raises:
        ServeError: it cannot listen as configured.
    """
    if not config.http.enabled:
        return None
    from gateway.service.http.server import HttpFront

    http = HttpFront(config, authenticator, engines, admission,
                     metrics=metrics.public_registry if metrics is not None else None)
    http.start()
    logger.info("OpenAI-compatible HTTP on %s (503 until the model has loaded)", http.url)
    return http


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
        ServeError, gateway.config.settings.ConfigError, gateway.engine.model.ModelLoadError:
            it could not start.
    """
    ensure_private_dir(config.data_dir)
    secret = deployment_secret(config, env)
    # NOTE: the listener's transport is judged before its keys, so a remote plaintext
    # listener hears about TLS first (the keys would not help it).
    check_plaintext_listener(config, config.host, config.address)
    authenticator = build_authenticator(config, announce,
                                        announces_to_terminal=announces_to_terminal)
    engines = EngineSlot()
    server = GatewayServer(config, authenticator, engines=engines)
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
    http: HttpFront | None = None
    try:
        http = start_http(config, authenticator, engines, server.admission, metrics)
    except BaseException:
        server.stop(0)
        raise
    # NOTE: imported once listening, so that health answers (NOT_SERVING) during the import.
    from gateway.cache.admin import CacheAdmin
    from gateway.cache.factory import eviction_cursor_path, open_cache
    from gateway.cache.invalidation import EvictionFeed
    from gateway.config.device import DeviceError, resolve_device
    from gateway.config.dtype import DtypeError, resolve_dtype
    from gateway.engine.engine import Engine, EngineConfig
    from gateway.engine.kv_sequence import pool_bytes_for
    from gateway.engine.model import load_model
    from gateway.engine.row_products import LinearKernel
    from gateway.engine.verdicts import VerdictStore
    from gateway.service.kv_events.publisher import KVEventPublisher, open_kv_events

    logger.info("listening on %s:%d; loading the model %s", config.host, server.port,
                config.model)
    opened = None
    kv_events: KVEventPublisher | None = None
    engine: Engine | None = None
    feed: EvictionFeed | None = None
    try:
        try:
            device = resolve_device(config.device)
            dtype = resolve_dtype(config.dtype, device)
        except (DeviceError, DtypeError) as exc:
            raise ServeError(str(exc)) from None
        with stage(f"loading the model {config.model} ({device}, "
                   f"{str(dtype).removeprefix('torch.')})"):
            loaded = load_model(config.model, cache_dir=config.data_dir / "models",
                                device=device, dtype=dtype)
        with stage("opening the cache tiers (recovering the disk tier's index)"):
            kv_events = open_kv_events(config.events)  # None unless [events] names an endpoint
            opened = open_cache(config.cache, layout=loaded.layout, deployment_secret=secret,
                                device=device, running_bytes=pool_bytes_for(
                                    config.engine.kv_budget_bytes
                                    + config.engine.tail_cache_bytes), tier_events=kv_events)
        start_metrics(config, metrics, opened.cache, device=str(device),
                      dtype=str(dtype).removeprefix("torch."))

        def evict_everywhere(keys: Sequence[BlockKey]) -> None:
            # A block shadow verification found divergent leaves every tier and every replica
            # (``admin`` exists before the engine serves anything that could be verified).
            for key in keys:
                admin.evict(key_hex=key.hex())

        engine = Engine(
            loaded=loaded,
            cache=opened.cache,
            config=EngineConfig(
                block_tokens=config.cache.block_tokens,
                max_queue=config.engine.max_queue,
                default_ttl_s=config.engine.default_ttl_s,
                max_prompt_tokens=config.engine.max_prompt_tokens,
                max_deadline_s=config.grpc.max_deadline_s,
                route=config.engine.route,
                step_tokens=config.engine.step_tokens,
                prefill_step_tokens=config.engine.prefill_step_tokens,
                max_running=config.engine.max_running,
                max_running_per_tenant=config.engine.max_running_per_tenant,
                max_queued_per_tenant=config.engine.max_queued_per_tenant,
                kv_budget_bytes=config.engine.kv_budget_bytes,
                max_kv_share_per_tenant=config.engine.max_kv_share_per_tenant,
                linear_kernel=cast(LinearKernel, config.engine.linear_kernel),
                tail_cache_bytes=config.engine.tail_cache_bytes,
                shadow_fraction=config.engine.shadow_fraction,
            ),
            deployment_secret=secret,
            metrics=metrics,
            verdicts=VerdictStore(config.data_dir / "routes", secret),
            cancelled=stop_requested.is_set,
            shadow_evict=evict_everywhere,
            pool=opened.pool,
        )
        with stage("choosing the engine route (remembered, or searched and probed)"):
            engine.start()
        watch_router(config, metrics, engine, opened.cache,
                     block_nbytes=loaded.layout.block_nbytes(config.cache.block_tokens))
        admin: CacheAdmin
        if opened.events is not None:
            # Evictions through other replicas reach this one's tiers (and those it missed
            # while down are applied before it serves).
            feed = EvictionFeed(opened.events, lambda event: admin.apply_event(event),
                                origin=secrets.token_hex(8),
                                cursor_path=eviction_cursor_path(config.cache))
        admin = CacheAdmin(opened.cache, keys=engine, feed=feed)
        if feed is not None:
            feed.start()
            metrics.watch_feed(feed)
            with stage("reading the evictions of other replicas"):
                feed.settled.wait(_CATCH_UP_S)
            if not feed.caught_up.is_set():
                logger.warning("serving before the evictions of other replicas were read: "
                               "Redis is slow or unreachable (they are applied once it is back)")
        if not stop_requested.is_set():
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
                engine.model_name, device, engine.dtype, "+".join(opened.cache.tier_names),
                authenticator.num_keys, engine.route.name, engine.route.reason,
            )
            announce(f"gRPC kvgate.v1 on {config.host}:{server.port}"
                     + (f"; OpenAI-compatible HTTP on {http.url}" if http is not None else
                        " (the HTTP front is off: [http] enabled = false)"))
            while not stop_requested.wait(_WATCH_INTERVAL_S):
                if feed is not None:
                    feed_behind = _watch_feed(feed, server, feed_behind)
                if stats is not None:
                    stats.tick()
                if server.engine_died.is_set():
                    raise ServeError("the engine's worker thread died (see the error logged "
                                     "above); exiting so that a supervisor restarts the gateway")
        logger.info("shutting down: finishing requests in flight (grace %.0f s)",
                    config.grpc.shutdown_grace_s)
    finally:
        stopped = server.begin_shutdown()
        if http is not None:
            http.begin_shutdown()
        is_worker_stopped = engine is None or engine.stop(config.grpc.shutdown_grace_s)
        stopped.wait(config.grpc.shutdown_grace_s + 1.0)
        server.stop(0)
        if http is not None:
            http.stop(config.grpc.shutdown_grace_s + 1.0)
        metrics.stop()  # its own port's, if served
        if feed is not None:
            feed.stop()
        if opened is not None:
            if is_worker_stopped:
                opened.close()
            else:
                logger.error("the engine's worker did not stop: the stores are left open "
                             "(closing them under it could lose or corrupt a write)")
        if kv_events is not None:
            kv_events.close()
        logger.info("stopped")

