"""One soak run: start the deployment, compute the cold answers, then the load and the faults
for ``minutes``, sampling the processes; stop everything by pid; the report."""

from __future__ import annotations

import random
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gateway.bench.rows import BenchError
from gateway.bench.soak.cluster import SoakRedisCluster
from gateway.bench.soak.faults import Deployment, FaultWindow, fault_kinds, not_run, run_schedule
from gateway.bench.soak.pins import check_all, pin_all
from gateway.bench.soak.processes import SoakRedis, SoakReplica, sample
from gateway.bench.soak.report import Sampled, SoakReport
from gateway.bench.soak.workload import (
    ClientContext,
    Outcome,
    catalogue,
    cold_answers,
    pinned_prompts,
    run_client,
)
from gateway.config.loader import parse_size

SAMPLE_EVERY_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakOptions:
    """``kvgate bench soak``'s settings (its ``--help`` says each)."""

    redis_binary: str
    redis_cli: str | None = None
    redis_cluster: bool = False
    model: str = "bundled"
    data_dir: Path = Path("data")
    minutes: float = 60.0
    replicas: int = 2
    clients: int = 6
    families: int = 3
    questions: int = 4
    rules: int = 24
    max_tokens: int = 8
    deadline_s: float = 60.0
    warmup_s: float = 20.0
    fault_every_s: float = 60.0
    pause_s: float = 10.0
    block_tokens: int = 64
    disk_bytes: str = "256MiB"
    start_timeout_s: float = 600.0
    seed: int = 0

    def problems(self) -> list[str]:
        found = []
        if not self.minutes > 0:
            found.append("--minutes must be more than 0")
        if not 1 <= self.replicas <= 8:
            found.append("--replicas must be 1 to 8")
        if not 1 <= self.clients <= 64:
            found.append("--clients must be 1 to 64")
        if not 1 <= self.families <= 3:
            found.append("--families must be 1 to 3")
        if self.fault_every_s < 5:
            found.append("--fault-every must be at least 5 seconds")
        if self.redis_cluster and self.redis_cli is None:
            found.append("--redis-cluster needs redis-cli")
        return found


def run_soak(options: SoakOptions, *, out: TextIO, err: TextIO) -> SoakReport:
    """Run the soak; the report (``problems()`` empty: passed).

    Raises:
        BenchError: the options are wrong, or the deployment could not start.
    """
    problems = options.problems()
    if problems:
        raise BenchError("; ".join(problems))
    root = Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
    api_key = "kvg-soak-" + secrets.token_urlsafe(24)
    admin_key = "kvg-soak-admin-" + secrets.token_urlsafe(24)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        redis: SoakRedis | SoakRedisCluster
        if options.redis_cluster:
            assert options.redis_cli is not None
            redis = SoakRedisCluster(options.redis_binary, options.redis_cli, root / "redis")
        else:
            redis = SoakRedis(options.redis_binary, root / "redis")
        stack.callback(redis.stop)  # whatever started is stopped, if the rest fails
        redis.start()
        err.write(f"[soak] {'Redis Cluster' if options.redis_cluster else 'redis-server'} "
                  f"on {redis.url}\n")
        secret = secrets.token_hex(32)
        replicas = [SoakReplica(name=f"replica-{i}", root=root / f"replica-{i}",
                                model=options.model, models_dir=options.data_dir / "models",
                                redis_url=redis.url, api_key=api_key, admin_key=admin_key,
                                secret_hex=secret, block_tokens=options.block_tokens,
                                disk_bytes=options.disk_bytes,
                                start_timeout_s=options.start_timeout_s,
                                redis_cluster=options.redis_cluster)
                    for i in range(options.replicas)]
        for replica in replicas:
            stack.callback(replica.unmount_disk)
            stack.callback(replica.stop)  # stopped before its disk is unmounted
            why_not = replica.mount_disk(_tmpfs_bytes(options.disk_bytes))
            if why_not is not None:
                err.write(f"[soak] {replica.name}'s disk tier is not size-limited ({why_not}): "
                          "the disk-full fault will not be made\n")
            replica.start()
            err.write(f"[soak] {replica.name} serving on 127.0.0.1:{replica.port} "
                      f"(pid {replica.pid})\n")
        prompts = catalogue(families=options.families, questions=options.questions,
                            num_rules=options.rules)
        err.write(f"[soak] computing the cold answers of {len(prompts)} prompts\n")
        assert replicas[0].port is not None
        cold = cold_answers(replicas[0].port, api_key, prompts, options.max_tokens,
                            options.deadline_s)
        pinned = pin_all(replicas, pinned_prompts(prompts), api_key=api_key,
                         admin_key=admin_key, tenant=replicas[0].tenant,
                         deadline_s=options.deadline_s)
        spared = _pinned_files(replicas, pinned, options.block_tokens, err)
        err.write(f"[soak] pinned {len(pinned_prompts(prompts))} prefixes on every replica "
                  f"({', '.join(f'{n} tokens' for n in sorted(set(pinned.values())))}; "
                  f"{len(spared)} block files, which the corruption fault spares)\n")
        report = _load(options, redis, replicas, spared, ClientContext(
            ports=lambda: [r.port or 0 for r in replicas], api_key=api_key,
            admin_key=admin_key, tenant=replicas[0].tenant, prompts=prompts, cold=cold,
            max_tokens=options.max_tokens, deadline_s=options.deadline_s), err)
        report.pins = check_all(replicas, pinned_prompts(prompts), pinned, api_key=api_key,
                                cold=cold, max_tokens=options.max_tokens,
                                deadline_s=options.deadline_s,
                                log=lambda line: _say(err, line))
        return report
    raise AssertionError("unreachable")


def _pinned_files(replicas: Sequence[SoakReplica], pinned: dict[tuple[str, str], int],
                  block_tokens: int, err: TextIO, timeout_s: float = 60.0) -> frozenset[str]:
    """The pinned prefixes' disk block files: every block file there is before the load (the
    cold answers store nothing), once the disk tier's queued writes hold them all."""
    deadline = time.monotonic() + timeout_s
    names: set[str] = set()
    for replica in replicas:
        want = sum(tokens // block_tokens for (_, name), tokens in pinned.items()
                   if name == replica.name)
        files = replica.disk_block_files()
        while len(files) < want and time.monotonic() < deadline:
            time.sleep(0.2)
            files = replica.disk_block_files()
        if len(files) < want:
            _say(err, f"[soak] {replica.name}'s disk holds {len(files)} of the {want} pinned "
                      "blocks' files before the load: the others may be corrupted by a fault")
        names.update(f.name for f in files)
    return frozenset(names)


def _say(err: TextIO, line: str) -> None:
    err.write(line + "\n")
    err.flush()


def _tmpfs_bytes(disk_bytes: str) -> int:
    """Room for the disk tier's budget and a quarter more (its files' headers, the index):
    the disk-full fault then fills what is left."""
    return parse_size(disk_bytes) * 5 // 4


def _load(options: SoakOptions, redis: SoakRedis | SoakRedisCluster,
          replicas: Sequence[SoakReplica], spared: frozenset[str], ctx: ClientContext,
          err: TextIO) -> SoakReport:
    started = time.time()
    stop_at = started + options.minutes * 60.0
    outcomes: list[Outcome] = []
    windows: list[FaultWindow] = []
    samples: list[Sampled] = []
    lock = threading.Lock()

    def record(outcome: Outcome) -> None:
        with lock:
            outcomes.append(outcome)

    def log(line: str) -> None:
        err.write(line + "\n")
        err.flush()

    threads = [threading.Thread(target=run_client, args=(ctx, i, stop_at, record),
                                name=f"soak-client-{i}", daemon=True)
               for i in range(options.clients)]
    deployment = Deployment(redis=redis, replicas=replicas, rng=random.Random(options.seed),
                            pause_s=options.pause_s, spared_files=spared)
    kinds = fault_kinds(cluster=options.redis_cluster)
    schedule = dict(d=deployment, kinds=kinds, started=started, first_at=started + options.warmup_s,
                    every_s=options.fault_every_s, stop_at=stop_at - 15.0, windows=windows,
                    lock=lock, log=log)
    threads.append(threading.Thread(target=run_schedule, kwargs=schedule, name="soak-faults",
                                    daemon=True))
    for thread in threads:
        thread.start()
    crashed: set[str] = set()
    while time.time() < stop_at or any(t.is_alive() for t in threads):
        at = time.time() - started
        for replica in replicas:
            samples.append(Sampled(at, replica.name, sample(replica.pid)))
            if replica.proc is not None and replica.proc.poll() is not None:
                crashed.add(replica.name)
        for name, pid in redis.named_pids():
            samples.append(Sampled(at, name, sample(pid)))
        with lock:
            done = len(outcomes)
        if int(at) % 30 < SAMPLE_EVERY_S:
            log(f"[soak] +{at:6.1f} s: {done} requests")
        if time.time() > stop_at + options.deadline_s + 120:
            break
        time.sleep(SAMPLE_EVERY_S)
    return SoakReport(outcomes=outcomes, windows=windows, samples=samples, started=started,
                      warmup_s=options.warmup_s, crashed=sorted(crashed),
                      not_run=not_run(cluster=options.redis_cluster))
