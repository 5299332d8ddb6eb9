"""``kvgate admin sessions ls | reset``: the sessions a replica knows, and ending one.

    kvgate admin sessions ls [--tenant T] [--json]
    kvgate admin sessions reset ID [--tenant T] [--json]

A session is what requests name with ``session_id`` (gRPC) or ``X-Session-Id`` (HTTP), inside
their tenant. ``ls`` shows what each owns on the replica asked (its own blocks, their bytes with
its conversation tail's), when it was last used and when it ends without another request.
``reset`` drops what the session owns from every tier, Redis included, and on every replica;
its next request starts cold (a shared system prompt it read stays). A session the replica does
not know -- or another tenant's -- is "nothing changed" (exit 3), as a reset that freed nothing.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TextIO

from gateway.cli.common import (
    EXIT_UNCHANGED,
    UsageError,
    format_bytes,
    printable,
    render_table,
)
from gateway.client import KvgateClient
from gateway.core.sessions import session_id_problem

LeafParser = Callable[[Any, str, str], argparse.ArgumentParser]
"""Adds one admin command, with the connection flags and ``--json``, to a subparsers action."""


def add_sessions_parser(admin_sub: Any, leaf: LeafParser, epilog: str) -> None:
    """``kvgate admin sessions ls | reset`` under ``admin_sub``."""
    sessions = admin_sub.add_parser("sessions", help="sessions: list them, or reset one",
                                    description=__doc__.split("\n\n")[2] if __doc__ else None,
                                    epilog=epilog)
    sub = sessions.add_subparsers(dest="sessions_command", required=True)
    ls = leaf(sub, "ls", "the sessions this replica knows, most recently used first")
    ls.add_argument("--tenant", default=None, help="only this tenant's")
    ls.add_argument("--limit", type=int, default=0, help="at most this many (server default)")
    reset = leaf(sub, "reset", "drop what a session owns from every tier and replica")
    reset.add_argument("session_id", metavar="ID", help="the session's id, as ls shows it")
    reset.add_argument("--tenant", default=None,
                       help="whose session (default: the one tenant with a session of that id)")


def run_sessions(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO,
                 stdin: TextIO) -> int:
    """``kvgate admin sessions ...``; returns the exit code."""
    if args.sessions_command == "ls":
        return _ls(client, args, out)
    return _reset(client, args, out, err)


def _ls(client: KvgateClient, args: argparse.Namespace, out: TextIO) -> int:
    sessions = client.list_sessions(tenant=args.tenant, limit=args.limit)
    if args.json:
        out.write(json.dumps([asdict(s) for s in sessions], indent=2) + "\n")
        return 0
    if not sessions:
        out.write("no sessions\n")
        return 0
    out.write(render_table(
        ["session", "tenant", "blocks", "bytes", "tail", "last used", "expires in"],
        [[s.session_id, s.tenant, str(s.num_blocks), format_bytes(s.num_bytes),
          f"{s.tail_tokens} tokens", f"{s.idle_s:.0f}s ago", f"{s.expires_in_s:.0f}s"]
         for s in sessions]))
    return 0


def _reset(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    problem = session_id_problem(args.session_id)
    if problem is not None:
        raise UsageError(f"ID: {problem}")
    reset = client.reset_session(args.session_id, tenant=args.tenant)
    if args.json:
        out.write(json.dumps(asdict(reset)) + "\n")
    else:
        out.write(f"reset session {args.session_id!r} of {printable(reset.tenant)}: freed "
                  f"{reset.num_blocks} blocks and {format_bytes(reset.tail_bytes)} of tail here\n")
        if reset.bytes_by_tier:
            out.write(render_table(["tier", "freed"],
                                   [[tier, format_bytes(n)]
                                    for tier, n in sorted(reset.bytes_by_tier.items())]))
    if reset.num_blocks == 0 and not reset.tail_bytes and not any(reset.bytes_by_tier.values()):
        err.write(f"kvgate admin sessions reset: nothing changed here: session "
                  f"{args.session_id!r} owned no block or tail on this replica (what it read is "
                  "shared with other requests, or was evicted already); the other replicas "
                  "were told to drop theirs\n")
        return EXIT_UNCHANGED
    return 0
