"""``[events]``: where the gateway publishes its KV events for routers, and the checks on it.

The events (``gateway.service.kv_events``) carry every cached prompt's token ids: whoever can
read them can read the prompts back with the tokenizer, and ZeroMQ here has neither
authentication nor encryption. So the publisher binds to loopback (``tcp://127.0.0.1:PORT``) or
a Unix socket (``ipc://PATH``) unless the operator says, with ``allow_remote = true``, that a
network policy keeps a routable port to the router. The check lives here, with the other
configuration checks, so that ``kvgate serve`` refuses before it starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.addresses import is_loopback

DEFAULT_TOPIC = "kv-events"
"""The topic vLLM's example subscriber and most router guides use (vLLM's own default is ""; a
subscriber to "" hears every topic, so it hears this one too)."""
DEFAULT_BUFFER = 10_000
"""Batches kept for replay: vLLM's ``buffer_steps`` default."""
MAX_BUFFER = 1_000_000
SCHEMES = ("tcp://", "ipc://")


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsSettings:
    """The KV-events publisher (vLLM's KV events format, ZeroMQ PUB plus a replay socket).

    Attributes:
        kv_events_endpoint: where the PUB socket binds, ``tcp://HOST:PORT`` or
            ``ipc://PATH``; empty (the default) publishes nothing.
        kv_events_replay_endpoint: where the replay (ROUTER) socket binds, for a router that
            joins late or missed a sequence number; empty: no replay.
        kv_events_topic: the first frame of every message (routers subscribe by it; llm-d
            expects ``kv@POD@MODEL``).
        kv_events_buffer: batches kept for replay, newest last.
        allow_remote: let the endpoints bind an address other machines can reach (a wildcard,
            or a routable address); the events carry prompt token ids.
    """

    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = DEFAULT_TOPIC
    kv_events_buffer: int = DEFAULT_BUFFER
    allow_remote: bool = False

    @property
    def is_enabled(self) -> bool:
        """Whether anything is published."""
        return bool(self.kv_events_endpoint)

    def problems(self) -> list[str]:
        """Every problem with these settings (the loader reports them all at once)."""
        errors = []
        if not isinstance(self.allow_remote, bool):
            errors.append(f"events.allow_remote must be true or false, got {self.allow_remote!r}")
        if not isinstance(self.kv_events_topic, str):
            errors.append(f"events.kv_events_topic must be a string, got "
                          f"{self.kv_events_topic!r}")
        buffer = self.kv_events_buffer
        if isinstance(buffer, bool) or not isinstance(buffer, int) or not (
                1 <= buffer <= MAX_BUFFER):
            errors.append(f"events.kv_events_buffer must be an integer from 1 to {MAX_BUFFER} "
                          f"(batches kept for replay), got {buffer!r}")
        allow_remote = self.allow_remote is True
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if not isinstance(value, str):
                errors.append(f"events.{name} must be a string such as "
                              f"\"tcp://127.0.0.1:5557\", got {value!r}")
            elif value:
                problem = endpoint_problem(value, allow_remote=allow_remote)
                if problem is not None:
                    errors.append(f"events.{name}: {problem}")
        if not errors:
            if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
                errors.append("events.kv_events_replay_endpoint needs kv_events_endpoint: there "
                              "is nothing to replay without the events")
            elif (self.kv_events_replay_endpoint
                  and self.kv_events_replay_endpoint == self.kv_events_endpoint):
                errors.append("events.kv_events_replay_endpoint must differ from "
                              "kv_events_endpoint (two sockets cannot bind one address)")
        return errors


def endpoint_problem(endpoint: str, *, allow_remote: bool) -> str | None:
    """What is wrong with ``endpoint`` as an address to bind, or None.

    Args:
        endpoint: ``tcp://HOST:PORT`` (HOST an address, ``localhost``, ``*`` for every
            interface, or ``[IPv6]``) or ``ipc://PATH``.
        allow_remote: whether an address other machines can reach is allowed.
    """
    if not endpoint.startswith(SCHEMES):
        return (f"{endpoint!r} is not tcp://HOST:PORT or ipc://PATH (inproc:// would reach "
                "only this process, not a router)")
    if endpoint.startswith("ipc://"):
        return None if endpoint.removeprefix("ipc://") else "ipc:// needs a path"
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not host:
        return f"{endpoint!r} needs a host and a port, e.g. tcp://127.0.0.1:5557"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{endpoint!r} needs a port from 1 to 65535 (routers must know where to connect)"
    if not allow_remote and not is_loopback(host):
        return (f"{endpoint!r} binds {host}, which other machines can reach, and the events "
                "carry the token ids of every cached prompt (the prompts themselves, to anyone "
                "with the tokenizer) without authentication or encryption. Bind 127.0.0.1 or "
                "ipc://PATH and run the router's subscriber beside kvgate, or set "
                "[events] allow_remote = true where a network policy keeps the port to the "
                "router")
    return None
