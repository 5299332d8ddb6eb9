"""``[server]``: where ``kvgate serve`` listens, what it serves and where it keeps its data, as a
record of its own (``ServerSettings``) that checks itself.

The command line's ``--host``, ``--port``, ``--data-dir``, ``--model``, ``--device`` and
``--dtype`` are values of this section (``gateway.config.loader`` merges them in first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gateway.config.device import device_problem
from gateway.config.dtype import dtype_problem
from gateway.config.settings import (
    DEFAULT_ADMIN_HOST,
    DEFAULT_DATA_DIR,
    DEFAULT_HOST,
    DEFAULT_MODEL,
    DEFAULT_PORT,
    is_int,
)

PATH_KEYS = ("data_dir", "tls_cert", "tls_key", "secret_file")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """The ``[server]`` section, one field per key (``ServeConfig`` has the same fields).

    Attributes:
        host, port: where to listen (port 0 picks a free one).
        data_dir: disk tier (``kv/``), model cache (``models/``), secret, dev key.
        model: ``bundled`` or a checkpoint directory.
        tls_cert, tls_key: PEM files; both or neither.
        allow_insecure_remote: listen on a non-loopback host without TLS.
        secret_file: the deployment secret (default ``data_dir/secret``).
        admin_host, admin_port: the Admin service's own listener; None: the main one.
        device: "auto", "cpu", "cuda", "cuda:N" (``gateway.config.device``).
        dtype: "auto", "float32", "bfloat16", "float16" (``gateway.config.dtype``).
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = DEFAULT_DATA_DIR
    model: str = DEFAULT_MODEL
    tls_cert: Path | None = None
    tls_key: Path | None = None
    allow_insecure_remote: bool = False
    secret_file: Path | None = None
    admin_host: str = DEFAULT_ADMIN_HOST
    admin_port: int | None = None
    device: str = "auto"
    dtype: str = "auto"

    @classmethod
    def of_table(cls, table: Mapping[str, Any]) -> ServerSettings:
        """The record of a ``[server]`` table whose keys are all known, paths made paths."""
        values = dict(table)
        for name in PATH_KEYS:
            value = values.get(name)
            if name == "data_dir" and value is not None:
                values[name] = Path(str(value)).expanduser()
            elif name in values:
                values[name] = None if value in (None, "") else Path(str(value)).expanduser()
        return cls(**values)

    def problems(self) -> list[str]:
        """Every problem with these settings, one line each, naming the key."""
        errors = []
        if not isinstance(self.host, str) or not self.host:
            errors.append(f"server.host must be a host name or address, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            errors.append(f"server.port must be 0 to 65535, got {self.port!r}")
        if not isinstance(self.model, str) or not self.model:
            errors.append(f"server.model must be 'bundled' or a directory, got {self.model!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            errors.append("server.tls_cert and server.tls_key go together: give both or "
                          "neither")
        for name, path in (("tls_cert", self.tls_cert), ("tls_key", self.tls_key)):
            if path is not None and not path.is_file():
                errors.append(f"server.{name} {path} is not a file")
        if not isinstance(self.allow_insecure_remote, bool):
            errors.append("server.allow_insecure_remote must be true or false")
        if not isinstance(self.admin_host, str) or not self.admin_host:
            errors.append(f"server.admin_host must be a host name or address, got "
                          f"{self.admin_host!r}")
        admin_port = self.admin_port
        if admin_port is not None and (not is_int(admin_port) or not 0 <= admin_port <= 65535):
            errors.append(f"server.admin_port must be 0 to 65535 (or left out: the Admin "
                          f"service on the main listener), got {admin_port!r}")
        elif admin_port is not None and admin_port == self.port and admin_port != 0:
            errors.append("server.admin_port must differ from server.port")
        errors += [problem for problem in (device_problem(self.device),
                                           dtype_problem(self.dtype)) if problem is not None]
        return errors

    def values(self) -> dict[str, Any]:
        """The fields by name (``ServeConfig(**server.values(), ...)``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
