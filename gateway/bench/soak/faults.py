"""The soak's faults: what fails, when, and for how long its window counts (an error inside a
fault's window, plus ``GRACE_S``, is expected; outside, it is a failure).

Each fault is a function over the running deployment that returns when the fault is over
(the killed process restarted, the stopped one resumed). With ``--redis-cluster`` the Redis
faults act on the cluster: all of it killed and restarted, or stopped; one master slowed, one
master's value corrupted; and one more fault, a master failed over (``redis_cluster_failover``).
``fault_kinds`` says which a run makes, ``not_run`` which it does not, and why.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from gateway.bench.soak.cluster import SoakRedisCluster
from gateway.bench.soak.processes import SoakRedis, SoakReplica

GRACE_S = 10.0
"""How long after a fault ends its errors still count as the fault's."""

CLUSTER_ONLY: Mapping[str, str] = {
    "redis_cluster_failover": "a --redis-cluster run's fault (a master failed over)",
}
"""Faults only a Redis Cluster run makes, and what a standalone run says of them."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """What a fault acts on."""

    redis: SoakRedis | SoakRedisCluster
    replicas: Sequence[SoakReplica]
    rng: random.Random
    pause_s: float
    spared_files: frozenset[str] = frozenset()
    """Disk block files the corruption fault leaves alone: the pinned prefixes' (a block the
    fault damages is lost by design; the pinned-blocks check is about kills and restarts)."""


@dataclass(slots=True)
class FaultWindow:
    """One fault as it happened (wall-clock seconds); ``note`` says what it did."""

    kind: str
    started: float
    ended: float = 0.0
    note: str = ""


def redis_kill_restart(d: Deployment) -> str:
    d.redis.kill()
    time.sleep(1.0)
    d.redis.start()
    if isinstance(d.redis, SoakRedisCluster):
        return "every node of the Redis Cluster killed (-9) and restarted empty"
    return f"redis-server killed (-9) and restarted empty on port {d.redis.port}"


def redis_pause(d: Deployment) -> str:
    d.redis.signal(signal.SIGSTOP)
    time.sleep(d.pause_s)
    d.redis.signal(signal.SIGCONT)
    what = "every node of the Redis Cluster" if isinstance(d.redis, SoakRedisCluster) else \
        "redis-server"
    return f"{what} stopped (SIGSTOP) for {d.pause_s:g} s"


def redis_slow(d: Deployment) -> str:
    seconds = min(2.0, d.pause_s)
    port = d.rng.choice(d.redis.master_ports())
    with socket.create_connection(("127.0.0.1", port), timeout=seconds + 5) as sock:
        sock.sendall(f"DEBUG SLEEP {seconds}\r\n".encode())
        reply = sock.recv(256)
    if not reply.startswith(b"+OK"):
        raise RuntimeError(f"DEBUG SLEEP answered {reply[:120]!r}")
    return f"redis-server on port {port} slept {seconds:g} s (DEBUG SLEEP)"


def replica_kill_restart(d: Deployment) -> str:
    replica = d.rng.choice(list(d.replicas))
    replica.kill()
    replica.start()
    return f"{replica.name} killed (-9) and restarted on its data"


def disk_block_corrupt(d: Deployment) -> str:
    for replica in d.rng.sample(list(d.replicas), len(d.replicas)):
        files = [f for f in replica.disk_block_files() if f.name not in d.spared_files]
        if files:
            path = d.rng.choice(files)
            try:
                fh = path.open("r+b")
            except FileNotFoundError:  # evicted since it was listed
                continue
            with fh:
                middle = os.fstat(fh.fileno()).st_size // 2
                fh.seek(middle)
                chunk = fh.read(16)
                fh.seek(middle)
                fh.write(bytes(b ^ 0xFF for b in chunk))
            return f"16 bytes flipped in {replica.name}'s disk block {path.name}"
    return "no disk block to corrupt yet"


def disk_full(d: Deployment) -> str:
    """A replica's disk tier (on its tmpfs) filled to ENOSPC for ``pause_s``, then freed."""
    mounted = [r for r in d.replicas if r.disk_mounted]
    if not mounted:
        raise RuntimeError("no replica's disk tier is on a size-limited filesystem "
                           "(mounting a tmpfs needs root)")
    replica = d.rng.choice(mounted)
    filler = replica.data_dir / "kv" / ".soak-filler"
    written = 0
    try:
        with filler.open("wb") as fh:
            block = bytes(1 << 20)
            while True:
                fh.write(block)
                fh.flush()
                written += len(block)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    time.sleep(d.pause_s)
    filler.unlink(missing_ok=True)
    return (f"{replica.name}'s disk tier filled to ENOSPC ({written >> 20} MiB more) for "
            f"{d.pause_s:g} s, then freed")


def redis_value_corrupt(d: Deployment) -> str:
    """16 bytes flipped in one block value (on a master of the cluster: its replica copies the
    change)."""
    for port in d.rng.sample(d.redis.master_ports(), len(d.redis.master_ports())):
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        try:
            for key in client.scan_iter(match="kvgate:*", count=1000):
                if client.type(key) == b"string" and (client.strlen(key) or 0) > 4096:
                    middle = int(client.strlen(key)) // 2
                    chunk = client.getrange(key, middle, middle + 15)
                    assert isinstance(chunk, bytes)
                    client.setrange(key, middle, bytes(b ^ 0xFF for b in chunk))
                    return (f"16 bytes flipped in Redis value "
                            f"{key.decode(errors='replace')[:60]} (port {port})")
        finally:
            client.close()
    return "no Redis block value to corrupt yet"


def redis_cluster_failover(d: Deployment) -> str:
    if not isinstance(d.redis, SoakRedisCluster):
        raise RuntimeError("needs --redis-cluster")
    return d.redis.fail_over(d.rng)


FAULTS: Mapping[str, Callable[[Deployment], str]] = {
    "redis_kill_restart": redis_kill_restart,
    "redis_pause": redis_pause,
    "redis_slow": redis_slow,
    "replica_kill_restart": replica_kill_restart,
    "disk_block_corrupt": disk_block_corrupt,
    "disk_full": disk_full,
    "redis_value_corrupt": redis_value_corrupt,
    "redis_cluster_failover": redis_cluster_failover,
}
"""Every fault the soak injects, in the order a run cycles through them."""


def fault_kinds(*, cluster: bool) -> list[str]:
    """The faults a run makes, in turn (the cluster's failover second, after Redis's kill)."""
    if not cluster:
        return [kind for kind in FAULTS if kind not in CLUSTER_ONLY]
    rest = [kind for kind in FAULTS if kind not in CLUSTER_ONLY]
    return rest[:1] + list(CLUSTER_ONLY) + rest[1:]


def not_run(*, cluster: bool) -> dict[str, str]:
    """The faults a run does not make, and why."""
    return {} if cluster else dict(CLUSTER_ONLY)


def run_schedule(d: Deployment, *, kinds: Sequence[str], started: float, first_at: float,
                 every_s: float, stop_at: float, windows: list[FaultWindow],
                 lock: threading.Lock, log: Callable[[str], None]) -> None:
    """Inject the faults ``kinds`` in turn, one every ``every_s`` from ``first_at``, until
    ``stop_at`` (each one's window appended to ``windows`` as it starts)."""
    at = first_at
    index = 0
    while at < stop_at:
        time.sleep(max(0.0, at - time.time()))
        if time.time() >= stop_at:
            return
        kind = kinds[index % len(kinds)]
        window = FaultWindow(kind=kind, started=time.time())
        with lock:
            windows.append(window)
        try:
            window.note = FAULTS[kind](d)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be made is reported
            window.note = f"could not be made: {type(exc).__name__}: {exc}"
        window.ended = time.time()
        log(f"[soak] +{window.started - started:6.1f} s {kind}: {window.note} "
            f"({window.ended - window.started:.1f} s)")
        index += 1
        at = max(at + every_s, time.time() + 1.0)
