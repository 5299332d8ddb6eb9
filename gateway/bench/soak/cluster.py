"""The soak's Redis Cluster (``--redis-cluster``): three masters with one replica each on free
loopback ports, without persistence (as ``deploy/`` runs Redis), every node started, killed and
restarted by pid in its own directory (where its ``nodes.conf`` keeps its place in the cluster
over a restart, and nothing else).

It answers what the faults ask of the standalone ``SoakRedis`` (``kill``, ``start``, ``signal``
act on every node: the whole cluster killed and restarted empty, or stopped), and one thing
more: ``fail_over``, a master killed (-9) so that its replica is promoted, then restarted as a
replica of it.
"""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

from gateway.bench.rows import BenchError
from gateway.bench.soak.processes import SoakRedis

NUM_MASTERS = 3
STATE_TIMEOUT_S = 60.0


class SoakRedisCluster:
    """Six ``redis-server`` nodes joined by ``redis-cli --cluster create ... --cluster-replicas
    1``; ``url`` names one node (a cluster client finds the rest)."""

    def __init__(self, binary: str, cli: str, workdir: Path) -> None:
        self.cli = cli
        self.nodes = [SoakRedis(binary, workdir / f"node-{i}", cluster=True)
                      for i in range(2 * NUM_MASTERS)]
        self._created = False

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def port(self) -> int:
        return self.nodes[0].port

    def named_pids(self) -> list[tuple[str, int | None]]:
        return [(f"redis-{i}", n.pid) for i, n in enumerate(self.nodes)]

    def start(self) -> None:
        """Start every node that is not running; the first time, join them into a cluster.
        Returns once every node says ``cluster_state:ok``."""
        for node in self.nodes:
            if node.proc is None:
                node.start()
        if not self._created:
            done = subprocess.run(
                [self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
                check=False)
            if done.returncode != 0:
                raise BenchError(f"redis-cli --cluster create failed: "
                                 f"{(done.stdout + done.stderr).strip()[-300:]}")
            self._created = True
        self.wait_ok(self.nodes)

    def wait_ok(self, nodes: list[SoakRedis]) -> None:
        """Until every one of ``nodes`` says ``cluster_state:ok`` and every replica among them
        has its link to its master up (NOTE: a replica that never synced will not be promoted:
        Redis takes its data for too old)."""
        deadline = time.monotonic() + STATE_TIMEOUT_S
        for node in nodes:
            while (b"cluster_state:ok" not in node.command("CLUSTER", "INFO")
                   or (node.role() == b"slave" and not node.is_linked())):
                if time.monotonic() > deadline:
                    raise BenchError(f"cluster node {node.port} never reached cluster_state:ok "
                                     "with its replication link up")
                time.sleep(0.1)

    def masters(self) -> list[SoakRedis]:
        """The nodes that are masters now (as they say themselves)."""
        return [n for n in self.nodes if n.proc is not None and n.role() == b"master"]

    def master_ports(self) -> list[int]:
        return [n.port for n in self.masters()]

    def fail_over(self, rng: random.Random) -> str:
        """Kill (-9) a master, wait until its replica is promoted and the cluster is ok, then
        restart the old master, which rejoins as its replica (and copies its data back)."""
        master = rng.choice(self.masters())
        replica = next((n for n in self.nodes if n.proc is not None
                        and n.master_port() == master.port), None)
        if replica is None:
            raise RuntimeError(f"master {master.port} has no replica")
        master.kill()
        started = time.monotonic()
        deadline = started + STATE_TIMEOUT_S
        while replica.role() != b"master":
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica.port} was never promoted")
            time.sleep(0.1)
        self.wait_ok([n for n in self.nodes if n.proc is not None])
        promoted_s = time.monotonic() - started
        master.start()
        while master.role() != b"slave":
            if time.monotonic() > deadline:
                raise RuntimeError(f"old master {master.port} did not rejoin as a replica")
            time.sleep(0.1)
        self.wait_ok(self.nodes)
        return (f"master {master.port} killed (-9); replica {replica.port} promoted in "
                f"{promoted_s:.1f} s; the old master restarted as its replica")

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def signal(self, signum: int) -> None:
        for node in self.nodes:
            node.signal(signum)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
