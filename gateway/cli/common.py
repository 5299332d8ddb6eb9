"""What the client commands share: connection flags, keys, exit codes, usage errors, tables.

``kvgate admin``, ``kvgate prewarm``, ``kvgate generate`` and ``kvgate bench ttft`` talk to a
running gateway the same way; this module holds that once, so that none of the commands
imports another. It imports only the client (never the server's layers) at module level, so
that a client command starts without loading torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.client import DEFAULT_HOST, DEFAULT_PORT, KvgateClient
from gateway.core.addresses import is_loopback

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNCHANGED = 3
"""A command that would change the gateway found nothing to change (``kvgate admin``)."""

DEV_KEY_FILE = "dev-api-key"
"""Where ``kvgate serve`` keeps its development key under its data directory.

NOTE: the same name as ``gateway.config.settings.DEV_KEY_FILE``, not imported from there:
loading the configuration layer loads the cache and torch (seconds) for one string.
"""
DEV_ADMIN_KEY_FILE = "dev-admin-key"
"""The development admin key's file (``gateway.config.settings.DEV_ADMIN_KEY_FILE``; as above)."""


class UsageError(Exception):
    """The command line cannot be acted on (exit 2); the message says what to change."""


def read_messages(
    path: Path | None,
) -> tuple[list[dict[str, str]] | None, list[dict[str, Any]] | None]:
    """Messages (and tools) from a JSON file: ``[{role, content}, ...]`` or
    ``{"messages": [...], "tools": [...]}`` (``kvgate generate`` and ``kvgate explain``).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON of that shape.
    """
    if path is None:
        return None, None
    data = json.loads(path.read_text(encoding="utf-8"))
    tools = None
    if isinstance(data, dict):
        tools = data.get("tools")
        data = data.get("messages")
    if not isinstance(data, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in data
    ):
        raise ValueError("expected a JSON list of {\"role\": ..., \"content\": ...} objects")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("`tools` must be a list of JSON objects")
    return [{"role": m["role"], "content": m["content"]} for m in data], tools


# ---- connecting ----------------------------------------------------------------------------


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Where the gateway is and the admin key (``kvgate admin`` and ``kvgate prewarm``)."""
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="the gateway's address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="its gRPC port, [server] port (default: %(default)s; not the HTTP "
                             "API's)")
    parser.add_argument("--admin-port", type=int, default=None,
                        help="the Admin service's own port, when the gateway serves it on a "
                             "listener of its own ([server] admin_port); default: --port")
    parser.add_argument("--admin-key", default=None,
                        help="admin key (default: $KVGATE_ADMIN_KEY, else the first admin key "
                             "of --config); other users can see it in `ps`, so prefer the "
                             "environment variable")
    parser.add_argument("--config", type=Path, default=None,
                        help="a `kvgate serve` configuration whose first [[admin_keys]] key "
                             "to use")
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--ca-cert", type=Path, default=None,
                        help="PEM of the CA that signed the gateway's certificate")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="deadline of each call in seconds")


def connector(args: argparse.Namespace) -> Callable[[str | None], KvgateClient]:
    """A factory of clients for the gateway ``args`` name, one per key."""
    root_certificates = args.ca_cert.read_bytes() if args.ca_cert is not None else None

    def connect(key: str | None) -> KvgateClient:
        try:
            return KvgateClient(args.host, args.port, key, tls=args.tls,
                                root_certificates=root_certificates, timeout_s=args.timeout,
                                admin_port=args.admin_port)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc

    return connect


# ---- keys ----------------------------------------------------------------------------------


def admin_key_of(args: argparse.Namespace, env: Mapping[str, str], *,
                 required: bool, data_dir: Path | None = None) -> str | None:
    """The admin key: ``--admin-key``, ``$KVGATE_ADMIN_KEY``, ``--config``'s first key, then
    the development admin key.

    The development admin key (``DATA_DIR/dev-admin-key``, written by ``kvgate serve`` when no
    key is configured) is read only for a gateway on a loopback address, as ``api_key_of``
    reads the development tenant key.

    Args:
        data_dir: where ``kvgate serve`` keeps the development keys; None never reads them.

    Raises:
        UsageError: the configuration cannot be read, or ``required`` and none was found.
    """
    key = args.admin_key or env.get("KVGATE_ADMIN_KEY") or None
    if key is None and args.config is not None:
        from gateway.config.loader import read_config_file
        from gateway.config.settings import ConfigError

        try:
            raw = read_config_file(args.config)
        except ConfigError as exc:
            raise UsageError(str(exc)) from exc
        items = raw.get("admin_keys", [])
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and isinstance(item.get("key"), str):
                key = item["key"]
                break
        else:
            raise UsageError(f"{args.config} has no [[admin_keys]] entry with a plain `key` "
                             "(digests cannot be sent): use --admin-key or $KVGATE_ADMIN_KEY")
    if key is None and data_dir is not None and is_loopback(args.host):
        dev_key = data_dir / DEV_ADMIN_KEY_FILE
        if dev_key.is_file():
            key = dev_key.read_text(encoding="ascii").strip()
    if key is None and required:
        raise UsageError("no admin key: give --admin-key, set $KVGATE_ADMIN_KEY, or --config "
                         "a file with [[admin_keys]] (a `kvgate serve` with no keys configured "
                         "writes one to DATA_DIR/dev-admin-key, read for a gateway on this "
                         "machine: --data-dir)")
    return key


def api_key_of(api_key: str | None, env: Mapping[str, str], *, host: str,
               data_dir: Path | None) -> str | None:
    """The tenant key: ``--api-key``, ``$KVGATE_API_KEY``, then the development key.

    The development key (``DATA_DIR/dev-api-key``, written by ``kvgate serve`` when no key is
    configured) is read only for a gateway on a loopback address: a gateway elsewhere has a
    key of its own, and this machine's dev key must not travel to it.

    Args:
        api_key: ``--api-key`` (None when not given).
        host: the gateway's address.
        data_dir: where ``kvgate serve`` keeps the dev key; None never reads it.
    """
    key = api_key or env.get("KVGATE_API_KEY") or None
    if key is None and data_dir is not None and is_loopback(host):
        dev_key = data_dir / DEV_KEY_FILE
        if dev_key.is_file():
            key = dev_key.read_text(encoding="ascii").strip()
    return key


# ---- output --------------------------------------------------------------------------------


def printable(text: str) -> str:
    """``text`` safe to write to an operator's terminal: every character that is not printable
    -- C0 and C1 controls (ESC begins the escape sequences that retitle a window, move the
    cursor, rewrite the screen or, in some terminals, write files), DEL, bidirectional and
    other format characters, line and paragraph separators -- as a Python-style escape
    (``\\x1b``, ``\\u202e``). Every table and line of the client commands that shows text a
    client chose (prefix previews, tags, session ids, tenants) goes through here.

    NOTE: a backslash is left as it is, so that escaping twice changes nothing (a preview
    passes ``first_words`` and then a table); a text that holds ``\\x1b`` literally reads the
    same as one holding ESC, which shows nothing harmful either way.
    """
    if text.isprintable():
        return text
    return "".join(_escaped(char) for char in text)


def _escaped(char: str) -> str:
    if char.isprintable():
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: left-aligned text, columns padded to their widest cell, every cell
    through ``printable`` (cells hold client-chosen text)."""
    headers = [printable(cell) for cell in headers]
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
             for line in (headers, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def format_bytes(num_bytes: int) -> str:
    """``512 B``, ``1.5 KiB`` ... ``3.0 GiB`` (binary units, one decimal)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{num_bytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def first_words(text: str, limit: int = 40) -> str:
    """``text`` on one line, cut to ``limit`` characters with ``...``, through ``printable``
    (the cut counts characters before escaping)."""
    words = " ".join(text.split())
    return printable(words if len(words) <= limit else words[: limit - 3].rstrip() + "...")
