"""The soak's processes: one ``redis-server`` and the ``kvgate serve`` replicas, each
restartable on the same port and data (a kill -9 and a restart are faults the soak injects),
each sampled for resident memory, open descriptors and threads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from gateway.bench.rows import BenchError
from gateway.bench.spawn import SPAWN_TENANT, free_port, spawn_config, stop_process, wait_serving


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One look at a process: resident memory, open descriptors and threads (None: gone)."""

    rss_bytes: int | None
    open_fds: int | None
    threads: int | None


def sample(pid: int | None) -> ProcessSample:
    """What /proc says of ``pid`` now."""
    if pid is None:
        return ProcessSample(None, None, None)
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) * 1024
        threads = int(fields["Threads"])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, KeyError, ValueError):
        return ProcessSample(None, None, None)
    return ProcessSample(rss, fds, threads)


CLUSTER_NODE_TIMEOUT_MS = 3000
"""How long a cluster node may be silent before the others count it failed: a master killed is
replaced by its replica after about this long. Longer than the slow-Redis fault's
``DEBUG SLEEP`` (2 s at most), so that a slowed master is not failed over."""


class SoakRedis:
    """A ``redis-server`` on one loopback port, without persistence (as ``deploy/`` runs it):
    a restart comes back empty. With ``cluster``, a node of a Redis Cluster
    (``gateway.bench.soak.cluster``) on its own bus port, whose ``nodes.conf`` in ``workdir``
    keeps its place in the cluster over a restart."""

    def __init__(self, binary: str, workdir: Path, *, cluster: bool = False) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.cluster_args = (["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                              "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                              "--cluster-port", str(free_port()),
                              # a replica syncs at once (not 5 s later): one that never
                              # synced is not promoted
                              "--repl-diskless-sync-delay", "0"] if cluster else [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}" + ("" if self.cluster_args else "/0")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def named_pids(self) -> list[tuple[str, int | None]]:
        """The processes to sample, by name."""
        return [("redis", self.pid)]

    def master_ports(self) -> list[int]:
        """The ports of the servers holding blocks (the slow and corrupt faults pick one)."""
        return [self.port]

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir),
             # DEBUG SLEEP is the slow-Redis fault; Redis 7 refuses DEBUG unless allowed
             "--enable-debug-command", "local", *self.cluster_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{self.binary} did not start on 127.0.0.1:{self.port}")
            time.sleep(0.05)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def command(self, *args: str) -> bytes:
        """One command's reply as bytes (b"" when the server does not answer)."""
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                             socket_connect_timeout=2)
        try:
            reply = client.execute_command(*args)  # type: ignore[no-untyped-call]
        except redis.RedisError:
            return b""
        finally:
            client.close()
        return reply if isinstance(reply, bytes) else repr(reply).encode()

    def role(self) -> bytes:
        """``master`` or ``slave`` (b"" when it does not answer)."""
        reply = self._role()
        return reply[0] if reply and isinstance(reply[0], bytes) else b""

    def master_port(self) -> int | None:
        """The port of the master this node replicates (None: it is a master, or silent)."""
        reply = self._role()
        return int(str(reply[2])) if reply and reply[0] == b"slave" else None

    def is_linked(self) -> bool:
        """A replica whose link to its master is up."""
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                             socket_connect_timeout=2)
        try:
            return client.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _role(self) -> list[object]:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                             socket_connect_timeout=2)
        try:
            return list(client.execute_command("ROLE"))  # type: ignore[no-untyped-call]
        except redis.RedisError:
            return []
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def signal(self, signum: int) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signum)

    def stop(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGCONT)  # a stopped server cannot exit
            stop_process(self.proc, grace_s=5)
            self.proc = None


class SoakReplica:
    """``kvgate serve`` on its own data directory (disk tier included), restartable on it."""

    def __init__(self, *, name: str, root: Path, model: str, models_dir: Path,
                 redis_url: str, api_key: str, admin_key: str, secret_hex: str,
                 block_tokens: int, disk_bytes: str, start_timeout_s: float,
                 redis_cluster: bool = False) -> None:
        self.name = name
        self.root = root
        self.api_key = api_key
        self.admin_key = admin_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._model = model
        self._start_timeout_s = start_timeout_s
        self._secret_hex = secret_hex
        root.mkdir(parents=True, exist_ok=True)
        self.data_dir = root / "data"
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        models = self.data_dir / "models"
        if not models.exists():
            models_dir.mkdir(parents=True, exist_ok=True)
            models.symlink_to(models_dir.resolve(), target_is_directory=True)
        config = spawn_config(block_tokens=block_tokens, device_bytes=256 << 20,
                              redis_url=redis_url, api_key=api_key, admin_key=admin_key,
                              skip_slow_tiers=False, calls_per_key=64,
                              # a small disk tier, so that the load fills it and evicts;
                              # a host tier the load fills in its first minutes, so that
                              # memory after that is judged steady, not still filling
                              host_bytes="256MiB", disk_bytes=disk_bytes,
                              redis_timeout_s=1.0,
                              redis_cluster=redis_cluster)
        self.config_path = root / "kvgate.toml"
        self.config_path.write_text(config, encoding="utf-8")
        self.config_path.chmod(0o600)
        self.tenant = SPAWN_TENANT
        self.disk_mounted = False
        self.num_starts = 0

    def start(self) -> None:
        self.num_starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        env["KVGATE_DEPLOYMENT_SECRET"] = self._secret_hex
        log = self.root / "serve.log"
        model = self._model if self._model == "bundled" else str(Path(self._model).resolve())
        with log.open("ab") as log_fh:
            log_fh.write(f"\n---- start at {time.time():.0f}\n".encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli.main", "serve", "--config",
                 str(self.config_path), "--host", "127.0.0.1", "--port", str(self.port or 0),
                 "--data-dir", str(self.data_dir), "--model", model],
                stdout=subprocess.DEVNULL, stderr=log_fh, env=env)
        offset = log.stat().st_size - 1
        self.port, _, _ = wait_serving(self.proc, log, self._start_timeout_s, offset=offset)

    def kill(self) -> None:
        """SIGKILL, whatever it was writing (``proc`` is None first: a sampler never takes
        the killed process for a crashed one)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, grace_s=10)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def mount_disk(self, size_bytes: int) -> str | None:
        """Put the disk tier on a tmpfs of ``size_bytes`` (so that it can be filled to ENOSPC);
        None when mounted, else why not (not root, or mount refused)."""
        kv = self.data_dir / "kv"
        kv.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() != 0:
            return "mounting a tmpfs needs root"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700",
                               "tmpfs", str(kv)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"mount refused: {done.stderr.strip()[:200]}"
        self.disk_mounted = True
        return None

    def unmount_disk(self) -> None:
        if self.disk_mounted:
            subprocess.run(["umount", "-l", str(self.data_dir / "kv")], capture_output=True,
                           check=False)
            self.disk_mounted = False

    def disk_block_files(self) -> list[Path]:
        """The disk tier's block files now (the corruption fault picks one)."""
        kv = self.data_dir / "kv"
        found = []
        for path in kv.rglob("*.kvb"):  # not a write in flight (``*.kvb.<id>.tmp``)
            try:
                if path.is_file() and path.stat().st_size > 4096:
                    found.append(path)
            except FileNotFoundError:  # evicted while we looked
                continue
        return sorted(found)
