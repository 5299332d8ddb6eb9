"""The engine's settings, written once: ``EngineSettings`` is the ``[engine]`` section of the
config file as it is, ``EngineConfig`` is what an ``Engine`` runs with (those settings plus the
three it takes from elsewhere).

``gateway.config`` builds ``EngineSettings`` from the file (its field names are the TOML keys, its
``problems()`` the messages an operator reads) and ``kvgate serve`` turns it into the engine's
``EngineConfig`` with ``EngineConfig.of``, filling in ``block_tokens`` from ``[cache]`` and
``max_deadline_s`` from ``[grpc]`` so that the two places that need them cannot disagree. The
config layer imports this module, never the other way round (tests/architecture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from gateway.engine.linear.row_products import LINEAR_KERNELS, LinearKernel
from gateway.engine.parity.route_search import SearchSettings
from gateway.engine.scheduling.scheduler import ScheduleLimits

ROUTES = ("auto", "batched", "serial")

PREFILL_STEP_TOKENS = {"cpu": 1024, "cuda": 8192}
"""``prefill_step_tokens`` where the config leaves it out, by device type: a GPU step costs its
launches (tens of microseconds each) whatever its rows, so fewer, larger prefill steps bring a
cold prompt close to one-shot; on a CPU the arithmetic dominates and 1,024 keeps a newcomer's
wait short. Other devices take the CPU's."""


def is_int(value: object) -> bool:
    """An ``int`` and not a ``bool`` (TOML's ``true`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive(value: object) -> bool:
    """A finite number > 0 (not a ``bool``)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """The engine's settings that are not shared with the cache or the gRPC limits: the
    ``[engine]`` section, one field per key.

    ``block_tokens`` comes from ``[cache]`` and ``max_deadline_s`` from ``[grpc]``, so that the
    two places that need them cannot disagree (``EngineConfig.of``).

    Attributes:
        max_queue: requests waiting for the model, all tenants; more get RESOURCE_EXHAUSTED.
        default_ttl_s: TTL of blocks whose request sent none (None: no expiry).
        max_prompt_tokens: longest prompt accepted (None: the model's context minus 1).
        route: "auto" (the batched invariant forward if the start-up probe passes, else the
            serial exact route), "batched" or "serial".
        step_tokens: tokens one engine step computes at most (decode rows + prefill chunks).
        prefill_step_tokens: tokens a step computes at most while no request is decoding (no
            one waits for a next token, and larger chunks prefill faster); None (the
            default): ``PREFILL_STEP_TOKENS`` of the engine's device (``EngineConfig.of``).
        max_lone_step_s: how long one of those large steps may take at the engine's measured
            prefill speed: a tenant arriving while it runs waits that long before its prompt is
            prefilled (``gateway.engine.scheduling.scheduler``).
        max_running: requests running at once.
        max_running_per_tenant: requests one tenant runs at once.
        max_queued_per_tenant: requests one tenant may have waiting; more: RESOURCE_EXHAUSTED.
        kv_budget_bytes: memory the running requests' KV buffers may take together (the pages
            of a cached prefix they share are the device tier's).
        max_kv_share_per_tenant: the fraction of ``kv_budget_bytes`` one tenant's running
            requests may hold, in (0, 1]; a tenant with nothing running may still start one
            request of any size. Not lent to a tenant alone (nothing is preempted for another
            tenant: one arriving would wait for its requests to end); one tenant only: set 1.0
            (``gateway.engine.scheduling.scheduler``).
        linear_kernel: what multiplies the batched forward's rows by the weights: "auto"
            (kvgate's panel kernel on a CPU in float32 where the engine owns the weights, else
            oneDNN where it keeps a row's bits whatever the row count, else BLAS), "panels"
            (the same), "onednn" (oneDNN, else BLAS) or "blas"
            (``gateway.engine.linear.row_products``). Part of the cache namespace.
        pack_weights: the projection weights are laid out once at start-up, in place, in the
            layout their kernel reads: the panel kernel's panels (without them it is not
            used), or oneDNN's blocked layout where the start-up check finds every row keeps
            its bits (faster decode steps, no second copy of the weights:
            ``gateway.engine.linear.packed_weights``).
        tail_cache_bytes: memory for conversation tails (the K/V after a conversation's last
            full block, kept for its next turn; ``gateway.engine.kv.tail_cache``, only where
            decoding writes the K/V a prefill writes); 0 keeps none.
        shadow_fraction: the fraction of cache hits recomputed cold while the engine is idle
            and compared bit for bit, in [0, 1] (``gateway.engine.parity.shadow``); a block that
            differs is logged, evicted everywhere and counted
            (``kvgate_shadow_divergences_total``); 0 turns it off.
        captured_steps: decode-only steps replayed from CUDA graphs, one per padded row
            count (``gateway.engine.forward.captured_steps``), where the engine runs on CUDA with
            the Triton attention and decode rows share the product; elsewhere it changes nothing
            (the log says why). On by default since an H100 measured it (docs/gpu.md).
    """

    max_queue: int = 64
    default_ttl_s: float | None = 3600.0
    max_prompt_tokens: int | None = None
    route: str = "auto"
    step_tokens: int = 256
    prefill_step_tokens: int | None = None
    max_lone_step_s: float = 1.0
    max_running: int = 16
    max_running_per_tenant: int = 8
    max_queued_per_tenant: int = 32
    kv_budget_bytes: int = 2 << 30
    max_kv_share_per_tenant: float = 0.5
    linear_kernel: LinearKernel = "auto"
    pack_weights: bool = True
    tail_cache_bytes: int = 256 << 20
    shadow_fraction: float = 0.01
    captured_steps: bool = True

    def problems(self) -> list[str]:
        """What is wrong with these settings, one message per setting (none: usable)."""
        errors = []
        for name in ("max_queue", "step_tokens", "prefill_step_tokens", "max_running",
                     "max_running_per_tenant", "max_queued_per_tenant", "kv_budget_bytes"):
            value = getattr(self, name)
            if name == "prefill_step_tokens" and value is None:
                continue
            if not is_int(value) or value < 1:
                errors.append(f"engine.{name} must be an integer >= 1, got {value!r}")
        if not is_positive(self.max_lone_step_s):
            errors.append(f"engine.max_lone_step_s must be > 0, got {self.max_lone_step_s!r}")
        share = self.max_kv_share_per_tenant
        if not is_positive(share) or share > 1:
            errors.append(f"engine.max_kv_share_per_tenant must be a fraction in (0, 1], got "
                          f"{share!r}")
        if self.route not in ROUTES:
            errors.append(f"engine.route must be \"auto\", \"batched\" or \"serial\", got "
                          f"{self.route!r}")
        if self.linear_kernel not in LINEAR_KERNELS:
            errors.append("engine.linear_kernel must be "
                          + ", ".join(f'"{name}"' for name in LINEAR_KERNELS[:-1])
                          + f' or "{LINEAR_KERNELS[-1]}", got {self.linear_kernel!r}')
        if not is_int(self.tail_cache_bytes) or self.tail_cache_bytes < 0:
            errors.append(f"engine.tail_cache_bytes must be an integer >= 0, got "
                          f"{self.tail_cache_bytes!r}")
        if not isinstance(self.pack_weights, bool):
            errors.append(f"engine.pack_weights must be true or false, got "
                          f"{self.pack_weights!r}")
        if not isinstance(self.captured_steps, bool):
            errors.append(f"engine.captured_steps must be true or false, got "
                          f"{self.captured_steps!r}")
        shadow = self.shadow_fraction
        if (isinstance(shadow, bool) or not isinstance(shadow, int | float)
                or not 0 <= shadow <= 1):
            errors.append(f"engine.shadow_fraction must be a fraction in [0, 1], got {shadow!r}")
        if self.default_ttl_s is not None and not is_positive(self.default_ttl_s):
            errors.append(f"engine.default_ttl_s must be > 0, got {self.default_ttl_s!r}")
        if self.max_prompt_tokens is not None and (
            not is_int(self.max_prompt_tokens) or self.max_prompt_tokens < 1
        ):
            errors.append("engine.max_prompt_tokens must be an integer >= 1, got "
                          f"{self.max_prompt_tokens!r}")
        return errors


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig(EngineSettings):
    """How the engine runs requests: the ``[engine]`` settings and the three it takes from
    elsewhere. Refused at construction (``ValueError``) when any setting is unusable.

    Attributes:
        block_tokens: tokens per block; must equal the cache's (``[cache] block_tokens``).
        max_deadline_s: the longest any request may run, whatever its own deadline
            (``[grpc] max_deadline_s``).
        store_generated_blocks: store the blocks generated tokens fill (as decoded where
            decoding writes the prefill's K/V, recomputed on the serial route, and not at all
            on the batched route otherwise: see ``LoopSettings``).
        shadow_fraction: as ``EngineSettings``, but 0 by default here: an engine built in code
            (the tests') computes nothing it did not ask for; ``kvgate serve`` takes
            ``[engine] shadow_fraction``, 0.01 unless set.
        measure_recompute_at_start: time prefill steps before serving
            (``gateway.engine.parity.recompute_speed``); ``kvgate serve`` sets it where the cache
            judges a disk tier or Redis by it (``[cache] measure_at_start``).
    """

    block_tokens: int = 64
    max_deadline_s: float = 600.0
    store_generated_blocks: bool = True
    shadow_fraction: float = 0.0
    measure_recompute_at_start: bool = False

    def __post_init__(self) -> None:
        errors = self.problems()
        if not is_int(self.block_tokens) or self.block_tokens < 1:
            errors.append(f"block_tokens must be an integer >= 1, got {self.block_tokens!r}")
        if not is_positive(self.max_deadline_s):
            errors.append(f"max_deadline_s must be > 0, got {self.max_deadline_s!r}")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def prefill_tokens(self) -> int:
        """``prefill_step_tokens``, or the CPU's default where it is None (configs built in
        code; ``of`` fills it in for the device)."""
        return self.prefill_step_tokens or PREFILL_STEP_TOKENS["cpu"]

    @classmethod
    def of(cls, settings: EngineSettings, *, block_tokens: int, max_deadline_s: float,
           device_type: str = "cpu", measure_recompute_at_start: bool = False) -> EngineConfig:
        """The engine's config for the ``[engine]`` ``settings``, with the block size of the
        cache and the deadline cap of the gRPC limits; a ``prefill_step_tokens`` left out
        becomes ``PREFILL_STEP_TOKENS`` of ``device_type`` (the model's device).

        Raises:
            ValueError: a setting is unusable (the config loader has refused it already).
        """
        values = {f.name: getattr(settings, f.name) for f in fields(EngineSettings)}
        if values["prefill_step_tokens"] is None:
            values["prefill_step_tokens"] = PREFILL_STEP_TOKENS.get(device_type,
                                                                    PREFILL_STEP_TOKENS["cpu"])
        return cls(**values, block_tokens=block_tokens, max_deadline_s=max_deadline_s,
                   measure_recompute_at_start=measure_recompute_at_start)

    def search_settings(self) -> SearchSettings:
        """What the route search depends on in this configuration (and the verdict's key)."""
        return SearchSettings(route=self.route, linear_kernel=self.linear_kernel,
                              max_rows=max(self.step_tokens, self.prefill_tokens),
                              max_logit_rows=self.max_running,
                              pack_weights=self.pack_weights)

    def schedule_limits(self, *, is_serial: bool, can_preempt: bool = False) -> ScheduleLimits:
        """The scheduler's bounds on the route chosen (``is_serial``: the serial route;
        ``can_preempt``: a preempted request resumes to the same answer on it)."""
        return ScheduleLimits(
            step_tokens=self.step_tokens, prefill_step_tokens=self.prefill_tokens,
            max_running=self.max_running, max_running_per_tenant=self.max_running_per_tenant,
            max_queued_per_tenant=self.max_queued_per_tenant, max_queued=self.max_queue,
            kv_budget_bytes=self.kv_budget_bytes,
            max_kv_share_per_tenant=self.max_kv_share_per_tenant, is_serial=is_serial,
            max_lone_step_s=self.max_lone_step_s,
            block_tokens=self.block_tokens, can_preempt=can_preempt)
