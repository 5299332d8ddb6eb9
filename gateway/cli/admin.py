"""``kvgate admin``: the Admin service from a terminal.

    kvgate admin stats | ls | evict | pin | unpin | quota | flush | sessions   [--json]

The admin key comes from ``--admin-key``, else ``$KVGATE_ADMIN_KEY``, else the first
``[[admin_keys]]`` entry of ``--config FILE`` that holds the key itself (``key = "..."``; an
entry stored only as ``key_blake2b`` cannot be sent), else -- for a gateway on this machine --
the development admin key that ``kvgate serve`` writes with no keys configured
(``--data-dir``/dev-admin-key). Human tables by default; ``--json``
prints the records for scripts. ``evict`` and ``flush`` ask for confirmation on a terminal
unless ``--yes``; without a terminal and without ``--yes`` they refuse (exit 2) rather than
guess. A refused call (no admin key, a tenant key) prints the server's message and exits 1
with nothing changed.

A command that changes nothing -- an eviction or flush that frees no block, a pin or unpin
that flips none, a key that begins no cached block's key, a quota for a tenant the gateway has
no key for -- says why and exits 3, so that a script never mistakes it for success.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from gateway.cli.admin_sessions import add_sessions_parser, run_sessions
from gateway.cli.common import (
    EXIT_FAILED,
    EXIT_UNCHANGED,
    EXIT_USAGE,
    UsageError,
    add_connection_args,
    admin_key_of,
    connector,
    first_words,
    format_bytes,
    render_table,
)
from gateway.client import Evicted, KvgateClient, KvgateError, NotFound
from gateway.core.tags import tag_problem

_EXIT_CODES = (f"exit status: 0 done; {EXIT_FAILED} refused or failed (the server's message "
               f"says why); {EXIT_USAGE} a usage error or not confirmed; {EXIT_UNCHANGED} "
               "nothing to change (nothing matched, already so, or no such tenant), "
               "with the reason on stderr")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS_OF_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


# ---- durations -----------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``1h``, ``2d`` (fractions allowed).

    Raises:
        ValueError: not a duration.
    """
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration: write e.g. 90s, 15m, 1h or 2d")
    return float(match.group(1)) * _SECONDS_OF_UNIT[match.group(2)]


# ---- parser --------------------------------------------------------------------------------


def add_admin_parser(sub: Any) -> None:
    """The ``kvgate admin`` subcommands."""
    admin = sub.add_parser("admin", help="operate a running gateway (admin key)",
                           description=__doc__.split("\n\n")[1] if __doc__ else None,
                           epilog=_EXIT_CODES)
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)

    def command(name: str, help_text: str, sub: Any = admin_sub) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text,
                                                         epilog=_EXIT_CODES)
        add_connection_args(parser)
        parser.add_argument("--json", action="store_true", help="print JSON for scripts")
        parser.add_argument("--data-dir", type=Path, default=Path("data"),
                            help="where a local `kvgate serve` keeps its development admin "
                                 "key (dev-admin-key), used when no other key is given")
        return parser

    command("stats", "blocks, bytes and counters per tier and store")
    ls = command("ls", "cached prefixes, most recently used first")
    ls.add_argument("--tenant", default=None, help="only this tenant's ('' for shared)")
    ls.add_argument("--limit", type=int, default=0, help="at most this many (server default)")
    evict = command("evict", "drop the blocks a selector names")
    evict.add_argument("--tenant", default=None,
                       help="this tenant's blocks ('' for the shared scope); with --prefix: "
                            "the scope the prefix was warmed in")
    evict.add_argument("--prefix", default=None, metavar="TEXT",
                       help="prompts that begin with TEXT as warmed (needs --tenant): TEXT as "
                            "a system message -- how prewarm warms a text file and how a chat "
                            "under it begins -- or as a raw prompt")
    evict.add_argument("--key", default=None, metavar="HEX",
                       help="a cached prompt by its key as ls shows it, or any unique "
                            "beginning of a block's key: that block, everything after it, and "
                            "the blocks before it that no other prompt continues from")
    evict.add_argument("--older-than", default=None, metavar="AGE",
                       help="blocks idle longer than AGE (90s, 15m, 1h, 2d)")
    evict.add_argument("--tier", default=None, help="only from this tier")
    evict.add_argument("--tag", default=None, metavar="NAME",
                       help="the blocks warmed (or generated) with tag NAME -- `kvgate "
                            "prewarm --tag NAME` -- and everything built on them; with "
                            "--tenant: only that tenant's")
    evict.add_argument("--all", action="store_true", help="every block (no other selector)")
    evict.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    for name, what in (("pin", "keep a prefix from eviction"), ("unpin", "undo pin")):
        pin = command(name, what)
        pin.add_argument("prompt", nargs="?", default=None,
                         help="the prefix text, as a system message (as prewarm warms text "
                              "files); with --raw: raw text")
        pin.add_argument("--file", type=Path, default=None, help="read the text from FILE")
        pin.add_argument("--raw", action="store_true", help="the text is a raw prompt")
        pin.add_argument("--tenant", default="", help="the tenant's scope (default: the "
                                                      "admin's own)")
        pin.add_argument("--shared", action="store_true", help="the shared scope")
    quota = command("quota", "set (or remove) a tenant's byte quota")
    quota.add_argument("tenant", help="the tenant whose quota to set")
    quota.add_argument("size", help="bytes, e.g. 2GiB or 500MB, or 'none' to remove it")
    flush = command("flush", "drop every block of every tier (pinned ones too; blocks "
                              "in use by a running request stay)")
    flush.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    add_sessions_parser(admin_sub, lambda sub, name, what: command(name, what, sub), _EXIT_CODES)


# ---- commands ------------------------------------------------------------------------------


def run_admin(args: argparse.Namespace, *, out: TextIO, err: TextIO, env: Mapping[str, str],
              stdin: TextIO | None = None) -> int:
    """``kvgate admin ...``; returns the exit code."""
    name = f"kvgate admin {args.admin_command}"
    try:
        key = admin_key_of(args, env, required=True, data_dir=args.data_dir)
        run = _COMMANDS[args.admin_command]
        with connector(args)(key) as client:
            return run(client, args, out, err, stdin if stdin is not None else sys.stdin)
    except UsageError as exc:
        err.write(f"{name}: {exc}\n")
        return EXIT_USAGE
    except NotFound as exc:
        err.write(f"{name}: nothing changed: {exc.details}\n")
        return EXIT_UNCHANGED
    except KvgateError as exc:
        hint = ""
        if exc.code.name == "UNIMPLEMENTED":
            hint = (" (this port does not serve the Admin service: the gateway may serve it on "
                    "a listener of its own, [server] admin_port; pass --admin-port)")
        err.write(f"{name}: {exc}{hint}\n")
        return EXIT_FAILED


def _stats(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO,
           stdin: TextIO) -> int:
    stats = client.stats()
    if args.json:
        out.write(json.dumps(asdict(stats), indent=2) + "\n")
        return 0
    out.write(f"{stats.num_blocks} blocks in {stats.num_namespaces} namespaces, "
              f"{stats.num_remote_hits} remote hits, {stats.num_token_mismatches} token "
              "mismatches\n")
    if stats.engine is not None:
        e = stats.engine
        where = f" on {e.device} in {e.dtype}" if e.dtype else ""
        out.write(f"engine route {e.route} ({e.route_reason}){where}; {e.steps} steps, "
                  f"{e.prefill_tokens} prefill + {e.decode_tokens} decode tokens computed, "
                  f"up to {e.max_requests_in_step} requests per step, {e.dedup_waits} dedup "
                  f"waits, {e.tail_hits} conversation tails ({e.tail_tokens} tokens, "
                  f"{format_bytes(e.tail_bytes)} kept)\n")
    out.write(render_table(
        ["tier", "blocks", "used", "budget", "hits", "inserts", "promoted", "demoted",
         "evictions"],
        [[t.name, str(t.num_blocks), format_bytes(t.used_bytes), format_bytes(t.budget_bytes),
          str(t.hits), str(t.inserts), str(t.promotions), str(t.demotions),
          ",".join(f"{k}:{v}" for k, v in sorted(t.evictions.items())) or "-"]
         for t in stats.tiers]))
    if stats.stores:
        out.write(render_table(
            ["store", "available", "blocks", "bytes", "hits", "misses", "errors"],
            [[s.name, "yes" if s.is_available else "NO", str(s.num_blocks),
              format_bytes(s.num_bytes), str(s.hits), str(s.misses), str(s.errors)]
             for s in stats.stores]))
    return 0


def _ls(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO,
        stdin: TextIO) -> int:
    prefixes = client.list_prefixes(tenant=args.tenant, limit=args.limit)
    if args.json:
        out.write(json.dumps([asdict(p) for p in prefixes], indent=2) + "\n")
        return 0
    if not prefixes:
        out.write("no cached prefixes\n")
        return 0
    out.write(render_table(
        ["key", "tenant", "blocks", "tokens", "bytes", "tiers", "age", "idle", "hits",
         "pinned", "tags", "preview"],
        [[p.key_hex[:16], p.tenant or "(shared)", str(p.num_blocks), str(p.num_tokens),
          format_bytes(p.num_bytes), ",".join(p.tiers) or "-", f"{p.age_s:.0f}s",
          f"{p.idle_s:.0f}s", str(p.num_hits), "yes" if p.is_pinned else "no",
          ",".join(p.tags) or "-", first_words(p.preview, 30)]
         for p in prefixes]))
    return 0


def _evict(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO,
           stdin: TextIO) -> int:
    try:
        older_than_s = parse_duration(args.older_than) if args.older_than is not None else None
    except ValueError as exc:
        raise UsageError(f"--older-than: {exc}") from exc
    if args.tag is not None and (problem := tag_problem(args.tag)) is not None:
        raise UsageError(f"--tag: {problem}")
    selectors = {"tenant": args.tenant, "prefix": args.prefix, "key": args.key,
                 "older-than": args.older_than, "tier": args.tier, "tag": args.tag}
    named = {k: v for k, v in selectors.items() if v is not None}
    if not named and not args.all:
        raise UsageError("name what to evict: --tenant, --prefix, --key, --older-than, "
                         "--tier, --tag, or --all")
    if named and args.all:
        raise UsageError("--all evicts every block; give it without other selectors")
    what = "every block" if args.all else \
        "blocks with " + " ".join(f"--{k} {v!r}" for k, v in named.items())
    _confirm(f"Evict {what}?", args.yes, stdin, err)
    evicted = client.evict(tenant=args.tenant, prefix_text=args.prefix, key_hex=args.key,
                           older_than_s=older_than_s, tier=args.tier, everything=args.all,
                           tag=args.tag)
    _write_evicted(evicted, args.json, out)
    if _freed_nothing(evicted) and args.tier != "remote":
        err.write(f"kvgate admin evict: nothing changed: {_why_nothing_evicted(args)}\n")
        return EXIT_UNCHANGED
    return 0


def _freed_nothing(evicted: Evicted) -> bool:
    return evicted.num_blocks == 0 and not any(evicted.bytes_by_tier.values())


def _why_nothing_evicted(args: argparse.Namespace) -> str:
    """Why an eviction that the server accepted matched no block (the likely reasons)."""
    if args.all:
        return "the cache holds no block"
    reasons = ["no cached block matched every selector given, or the blocks that did are "
               "in use by running requests"]
    if args.prefix is not None:
        reasons.append(f"--prefix selects only a text whose every full block is cached in "
                       f"{args.tenant!r}'s scope, warmed as a system message or as a raw "
                       "prompt; part of a prompt selects nothing (use --key with a key from "
                       "`kvgate admin ls`)")
    if args.tag is not None:
        whose = " for that tenant" if args.tenant is not None else ""
        reasons.append(f"no block of this replica is tagged {args.tag!r}{whose} (`kvgate "
                       "admin ls` shows the tags; tags are kept in each replica's own index "
                       "and do not survive a restart)")
    if args.tenant is not None:
        reasons.append(f"`kvgate admin ls --tenant {args.tenant}` lists what that tenant holds")
    if args.tier is not None:
        reasons.append(f"--tier {args.tier} drops only the copies in that tier")
    return "; ".join(reasons)


def _flush(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO,
           stdin: TextIO) -> int:
    _confirm("Flush every block of every tier, pinned ones too?", args.yes, stdin, err)
    evicted = client.flush()
    _write_evicted(evicted, args.json, out)
    if _freed_nothing(evicted):
        err.write("kvgate admin flush: nothing changed: the cache holds no block (blocks in "
                  "use by running requests stay)\n")
        return EXIT_UNCHANGED
    return 0


def _pin(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO,
         stdin: TextIO) -> int:
    if (args.prompt is None) == (args.file is None):
        raise UsageError("give the prefix text or --file FILE (one of them)")
    if args.shared and args.tenant:
        raise UsageError("--tenant and --shared name different scopes; give one")
    if args.file is not None:
        try:
            text = args.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--file {args.file}: {exc}") from exc
    else:
        text = args.prompt
    unpin = args.admin_command == "unpin"
    if args.raw:
        num_blocks = client.pin(text, unpin=unpin, shared=args.shared, tenant=args.tenant)
    else:
        num_blocks = client.pin(None, unpin=unpin, messages=[{"role": "system",
                                                              "content": text}],
                                add_generation_prompt=False, shared=args.shared,
                                tenant=args.tenant)
    if args.json:
        out.write(json.dumps({"num_blocks": num_blocks}) + "\n")
    else:
        out.write(f"{args.admin_command}ned {num_blocks} blocks\n")
    if num_blocks == 0:
        scope = ("the shared scope" if args.shared else
                 f"tenant {args.tenant!r}'s scope" if args.tenant else
                 "the admin key's own scope (give --tenant NAME or --shared)")
        state = "pinned" if unpin else "unpinned"
        taken = "as a raw prompt" if args.raw else "as a system message (--raw: as a raw prompt)"
        err.write(f"kvgate admin {args.admin_command}: nothing changed: no {state} full block "
                  f"of the text is cached in {scope}; a pin keeps only what is cached (warm "
                  f"it first, e.g. `kvgate prewarm`), and the text is taken {taken}\n")
        return EXIT_UNCHANGED
    return 0


def _quota(client: KvgateClient, args: argparse.Namespace, out: TextIO, err: TextIO,
           stdin: TextIO) -> int:
    from gateway.config.loader import parse_size

    num_bytes: int | None = None
    if args.size.lower() != "none":
        try:
            num_bytes = parse_size(args.size)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    client.set_quota(args.tenant, num_bytes)
    if args.json:
        out.write(json.dumps({"tenant": args.tenant, "num_bytes": num_bytes}) + "\n")
    elif num_bytes is None:
        out.write(f"removed the quota of {args.tenant}\n")
    else:
        out.write(f"quota of {args.tenant}: {format_bytes(num_bytes)}\n")
    return 0


def _confirm(question: str, is_confirmed: bool, stdin: TextIO, err: TextIO) -> None:
    """Ask on a terminal; refuse (``UsageError``) without one, or on anything but yes."""
    if is_confirmed:
        return
    if not stdin.isatty():
        raise UsageError("refusing to change the cache without confirmation: stdin is not a "
                         "terminal; pass --yes")
    err.write(f"{question} [y/N] ")
    err.flush()
    if stdin.readline().strip().lower() not in ("y", "yes"):
        raise UsageError("not confirmed; nothing was changed")


def _write_evicted(evicted: Evicted, as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(asdict(evicted)) + "\n")
        return
    out.write(f"freed {evicted.num_blocks} blocks\n")
    if evicted.bytes_by_tier:
        out.write(render_table(["tier", "freed"],
                               [[tier, format_bytes(n)]
                                for tier, n in sorted(evicted.bytes_by_tier.items())]))


_Command = Callable[[KvgateClient, argparse.Namespace, TextIO, TextIO, TextIO], int]
_COMMANDS: dict[str, _Command] = {
    "stats": _stats, "ls": _ls, "evict": _evict, "pin": _pin, "unpin": _pin,
    "quota": _quota, "flush": _flush, "sessions": run_sessions,
}
