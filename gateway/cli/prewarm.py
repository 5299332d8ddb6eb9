"""``kvgate prewarm``: compute and store the KV of known system prompts before traffic arrives.

Inputs are files or directories (walked recursively, hidden files skipped):

- a plain text file is one system prompt, warmed as ``[{"role": "system", "content": text}]``
  without a generation prompt -- the tokens a chat request that starts with that system
  message begins with, so its requests hit the cache;
- a ``.yaml``/``.yml``/``.json`` file is a list of entries, each a string (a system prompt, as
  above) or a mapping of ``prompt`` (raw text, for completion-style requests) or ``messages``
  (+ optional ``tools``), and optionally ``tenant``, ``scope`` (``tenant`` or ``shared``),
  ``ttl_s`` and ``pin``. Unknown keys are an error that names them.

A file that cannot be used (missing, not UTF-8, invalid YAML/JSON, a bad entry) is reported
with its reason and skipped as a whole; the other files still warm. A prompt the server
refuses (longer than the context, ...) is reported with the server's message.

Which key warms an entry: shared scope -> the admin key; ``tenant: T`` -> the key given for T
(``--tenant-key KEY=T`` or ``$KVGATE_API_KEYS``, the ``kvgate serve`` form); otherwise the
default API key. ``pin`` pins through the Admin service (admin key), after the warm.

Warm is idempotent: a second run finds every block cached (``num_new_blocks == 0``) and
computes nothing.

``--tag NAME`` records NAME on the blocks of every prompt warmed (those it stores and those
already cached), so that ``kvgate admin evict --tag NAME`` drops exactly what this run warmed
(and what was built on it); ``kvgate admin ls`` shows the tags.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from gateway.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_connection_args,
    admin_key_of,
    api_key_of,
    connector,
    first_words,
    format_bytes,
    render_table,
)
from gateway.client import KvgateClient, KvgateError
from gateway.core.tags import tag_problem

STRUCTURED_SUFFIXES = frozenset({".yaml", ".yml", ".json"})
ENTRY_KEYS = frozenset({"prompt", "messages", "tools", "tenant", "scope", "ttl_s", "pin"})
SCOPES = ("tenant", "shared")


class PrewarmError(Exception):
    """A prewarm input that cannot be used (the message says why); the root of this module."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrewarmEntry:
    """One prompt to warm, and where it came from (``file`` or ``file[i]``)."""

    source: str
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    tools: tuple[Any, ...] | None = None
    tenant: str | None = None
    is_shared: bool = False
    ttl_s: float | None = None
    is_pinned: bool = False

    @property
    def label(self) -> str:
        """The prompt's first words, for tables and progress lines."""
        text = self.prompt if self.prompt is not None else " ".join(
            content for _, content in self.messages or ())
        return first_words(text)

    @property
    def num_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(content) for _, content in self.messages or ())


@dataclass(frozen=True, slots=True, kw_only=True)
class FileProblem:
    """A file (or entry) that was not warmed, and why."""

    source: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PrewarmResult:
    """What warming one entry did."""

    source: str
    label: str
    num_tokens: int
    num_blocks: int
    num_new_blocks: int
    num_bytes: int
    tiers: tuple[str, ...]
    elapsed_s: float

    @property
    def is_already_cached(self) -> bool:
        return self.num_blocks > 0 and self.num_new_blocks == 0

    @property
    def is_too_short(self) -> bool:
        """Shorter than one block: nothing of it can be cached (only full blocks are)."""
        return self.num_blocks == 0

    @property
    def cached_label(self) -> str:
        if self.is_too_short:
            return "shorter than a block"
        return "yes" if self.is_already_cached else "no"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyRing:
    """The keys prewarm may use: see the module docstring for which one an entry gets."""

    api_key: str | None = None
    admin_key: str | None = None
    tenant_to_key: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class PrewarmReport:
    results: list[PrewarmResult] = field(default_factory=list)
    problems: list[FileProblem] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "results": [
                {"source": r.source, "prompt": r.label, "tokens": r.num_tokens,
                 "blocks": r.num_blocks, "new_blocks": r.num_new_blocks, "bytes": r.num_bytes,
                 "tiers": list(r.tiers), "time_s": round(r.elapsed_s, 6),
                 "already_cached": r.is_already_cached}
                for r in self.results
            ],
            "failures": [{"source": p.source, "reason": p.reason} for p in self.problems],
        }


# ---- reading inputs ------------------------------------------------------------------------


def load_entries(paths: Iterable[Path]) -> tuple[list[PrewarmEntry], list[FileProblem]]:
    """Every entry of every file under ``paths``, and the files that could not be read."""
    entries: list[PrewarmEntry] = []
    problems: list[FileProblem] = []
    for path in paths:
        for file in _files(path, problems):
            try:
                entries.extend(read_file(file))
            except PrewarmError as exc:
                problems.append(FileProblem(source=str(file), reason=str(exc)))
    return entries, problems


def _files(path: Path, problems: list[FileProblem]) -> list[Path]:
    if path.is_dir():
        return sorted(
            p for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    if not path.exists():
        problems.append(FileProblem(source=str(path), reason="no such file or directory"))
        return []
    return [path]


def read_file(path: Path) -> list[PrewarmEntry]:
    """The entries of one file.

    Raises:
        PrewarmError: the file cannot be read or holds something that is not a valid entry.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise PrewarmError(f"cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise PrewarmError(f"not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    source = str(path)
    if path.suffix.lower() not in STRUCTURED_SUFFIXES:
        if not text.strip():
            raise PrewarmError("empty file")
        return [PrewarmEntry(source=source, messages=(("system", text),))]
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise PrewarmError(f"invalid JSON: {exc}") from exc
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PrewarmError(f"invalid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(data, list) or not data:
        raise PrewarmError("expected a non-empty list of entries")
    return [_entry(item, f"{source}[{i}]") for i, item in enumerate(data)]


def _entry(item: object, source: str) -> PrewarmEntry:
    where = source.rsplit("[", 1)[-1].rstrip("]")
    if isinstance(item, str):
        if not item.strip():
            raise PrewarmError(f"entry {where}: empty prompt")
        return PrewarmEntry(source=source, messages=(("system", item),))
    if not isinstance(item, dict):
        raise PrewarmError(f"entry {where}: expected a string or a mapping, got "
                           f"{type(item).__name__}")
    unknown = sorted(str(k) for k in set(item) - ENTRY_KEYS)
    if unknown:
        raise PrewarmError(f"entry {where}: unknown keys {unknown}; known: {sorted(ENTRY_KEYS)}")
    prompt, messages = item.get("prompt"), item.get("messages")
    if (prompt is None) == (messages is None):
        raise PrewarmError(f"entry {where}: give exactly one of `prompt` and `messages`")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise PrewarmError(f"entry {where}: `prompt` must be a non-empty string")
    parsed_messages = None
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and set(m) == {"role", "content"}
            and isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages
        ):
            raise PrewarmError(f"entry {where}: `messages` must be a non-empty list of "
                               "{role, content} strings")
        parsed_messages = tuple((m["role"], m["content"]) for m in messages)
    tools = item.get("tools")
    if tools is not None and (not isinstance(tools, list) or messages is None):
        raise PrewarmError(f"entry {where}: `tools` must be a list, beside `messages`")
    tenant = item.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise PrewarmError(f"entry {where}: `tenant` must be a string")
    scope = item.get("scope", "tenant")
    if scope not in SCOPES:
        raise PrewarmError(f"entry {where}: `scope` must be one of {list(SCOPES)}, got {scope!r}")
    if scope == "shared" and tenant is not None:
        raise PrewarmError(f"entry {where}: `tenant` goes only with scope tenant")
    ttl = item.get("ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                            or ttl <= 0):
        raise PrewarmError(f"entry {where}: `ttl_s` must be a positive number of seconds")
    pin = item.get("pin", False)
    if not isinstance(pin, bool):
        raise PrewarmError(f"entry {where}: `pin` must be true or false")
    return PrewarmEntry(
        source=source, prompt=prompt, messages=parsed_messages,
        tools=tuple(tools) if tools is not None else None, tenant=tenant,
        is_shared=scope == "shared", ttl_s=float(ttl) if ttl is not None else None,
        is_pinned=pin,
    )


# ---- warming -------------------------------------------------------------------------------


class Progress:
    """Progress on stderr: a redrawn bar on a TTY, one line per prompt otherwise.

    The bar measures characters (the token count of a prompt is known only once it is warmed),
    so the ETA is elapsed time scaled by the characters still to go.
    """

    def __init__(self, err: TextIO, *, total_chars: int, num_entries: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._err = err
        self._is_tty = err.isatty()
        self._total_chars = max(1, total_chars)
        self._num_entries = num_entries
        self._clock = clock
        self._began = clock()
        self._done_chars = 0
        self._done = 0
        self._tokens = 0

    def finished(self, entry: PrewarmEntry, result: PrewarmResult | None,
                 problem: FileProblem | None) -> None:
        self._done += 1
        self._done_chars += entry.num_chars
        if result is not None:
            self._tokens += result.num_tokens
        elapsed = max(1e-9, self._clock() - self._began)
        if self._is_tty:
            fraction = min(1.0, self._done_chars / self._total_chars)
            filled = int(fraction * 30)
            eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
            self._err.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {self._done}/{self._num_entries} "
                f"{self._tokens / elapsed:,.0f} tok/s ETA {eta:.0f}s   "
            )
            if self._done == self._num_entries:
                self._err.write("\n")
        elif result is not None:
            state = ("too short" if result.is_too_short
                     else "cached" if result.is_already_cached else "warmed")
            self._err.write(
                f"[{self._done}/{self._num_entries}] {state} {entry.source}: "
                f"{result.num_tokens} tokens, {result.num_blocks} blocks "
                f"({result.num_new_blocks} new) in {result.elapsed_s * 1000:.0f} ms\n"
            )
        elif problem is not None:
            self._err.write(f"[{self._done}/{self._num_entries}] FAILED {problem.source}: "
                            f"{problem.reason}\n")
        self._err.flush()


def warm_entries(entries: Sequence[PrewarmEntry], keys: KeyRing,
                 connect: Callable[[str | None], KvgateClient], *, err: TextIO,
                 clock: Callable[[], float] = time.monotonic,
                 tag: str | None = None) -> PrewarmReport:
    """Warm every entry, one at a time (the engine computes one prefill at a time anyway).

    Args:
        connect: a client for a key (called once per distinct key; the caller closes them).
        tag: recorded on every warmed prompt's blocks (``gateway.core.tags``).
    """
    report = PrewarmReport()
    clients: dict[str | None, KvgateClient] = {}

    def client_for(key: str | None) -> KvgateClient:
        if key not in clients:
            clients[key] = connect(key)
        return clients[key]

    progress = Progress(err, total_chars=sum(e.num_chars for e in entries),
                        num_entries=len(entries), clock=clock)
    for entry in entries:
        result, problem = None, None
        try:
            result = _warm_one(entry, keys, client_for, clock, tag)
            report.results.append(result)
        except (PrewarmError, KvgateError) as exc:
            problem = FileProblem(source=entry.source, reason=str(exc))
            report.problems.append(problem)
        progress.finished(entry, result, problem)
    return report


def _warm_one(entry: PrewarmEntry, keys: KeyRing,
              client_for: Callable[[str | None], KvgateClient],
              clock: Callable[[], float], tag: str | None) -> PrewarmResult:
    if entry.is_shared:
        key = keys.admin_key
        if key is None:
            raise PrewarmError("the shared scope needs an admin key (--admin-key or "
                               "$KVGATE_ADMIN_KEY)")
    elif entry.tenant is not None:
        key = keys.tenant_to_key.get(entry.tenant)
        if key is None:
            raise PrewarmError(f"no key for tenant {entry.tenant!r} (give --tenant-key "
                               f"KEY={entry.tenant} or $KVGATE_API_KEYS)")
    else:
        if entry.is_pinned:
            raise PrewarmError("`pin` in the tenant scope needs `tenant` (the tenant whose "
                               "prefix the admin key pins)")
        key = keys.api_key
    if entry.is_pinned and keys.admin_key is None:
        raise PrewarmError("`pin` needs an admin key (--admin-key or $KVGATE_ADMIN_KEY)")
    messages = [{"role": r, "content": c} for r, c in entry.messages] \
        if entry.messages is not None else None
    add_generation_prompt = False if messages is not None else None
    client = client_for(key)
    began = clock()
    warmed = client.warm(entry.prompt, messages=messages, tools=entry.tools,
                         add_generation_prompt=add_generation_prompt,
                         pin=entry.is_pinned and entry.is_shared, ttl_s=entry.ttl_s,
                         shared=entry.is_shared, tag=tag)
    if entry.is_pinned and not entry.is_shared:
        client_for(keys.admin_key).pin(entry.prompt, messages=messages,
                                       add_generation_prompt=add_generation_prompt,
                                       tenant=entry.tenant or "")
    elapsed = clock() - began
    looked = client.lookup(entry.prompt, messages=messages, tools=entry.tools,
                           add_generation_prompt=add_generation_prompt,
                           shared=entry.is_shared)
    return PrewarmResult(
        source=entry.source, label=entry.label, num_tokens=warmed.prompt_tokens,
        num_blocks=warmed.num_blocks, num_new_blocks=warmed.num_new_blocks,
        num_bytes=warmed.stored_bytes, tiers=tuple(sorted(looked.cached_tokens_by_tier)),
        elapsed_s=elapsed,
    )


# ---- output --------------------------------------------------------------------------------


def write_report(report: PrewarmReport, out: TextIO) -> None:
    """The results table, then the failures with their reasons."""
    rows = [
        [r.label, str(r.num_tokens), str(r.num_blocks), format_bytes(r.num_bytes),
         ",".join(r.tiers) or "-", f"{r.elapsed_s * 1000:.1f} ms",
         r.cached_label]
        for r in report.results
    ]
    if rows:
        out.write(render_table(
            ["prompt", "tokens", "blocks", "bytes", "tiers", "time", "already cached"], rows))
    num_cached = sum(r.is_already_cached for r in report.results)
    num_short = sum(r.is_too_short for r in report.results)
    short = f", {num_short} shorter than one block (nothing to cache)" if num_short else ""
    out.write(f"{len(report.results)} warmed ({num_cached} already cached{short}), "
              f"{len(report.problems)} failed\n")
    for problem in report.problems:
        out.write(f"FAILED {problem.source}: {problem.reason}\n")


def parse_tenant_keys(items: Iterable[str]) -> dict[str, str]:
    """``KEY=TENANT`` items (the ``KVGATE_API_KEYS`` form) as tenant -> key.

    Raises:
        ValueError: an item has no ``=TENANT`` (the message never shows the key).
    """
    tenant_to_key: dict[str, str] = {}
    for i, item in enumerate(part.strip() for part in items):
        if not item:
            continue
        key, sep, tenant = item.rpartition("=")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"tenant key {i + 1} is not KEY=TENANT")
        tenant_to_key[tenant.strip()] = key.strip()
    return tenant_to_key


# ---- command line --------------------------------------------------------------------------


def add_prewarm_parser(sub: Any) -> None:
    """The ``kvgate prewarm`` subcommand."""
    parser = sub.add_parser(
        "prewarm", help="warm system prompts from files into a running gateway",
        description="Warm every prompt of PATH... (text files: one system prompt each; "
                    ".yaml/.yml/.json: a list of {prompt | messages (+tools), tenant, scope, "
                    "ttl_s, pin}). Progress goes to stderr, the table to stdout. Exit 0 if "
                    "everything warmed, 1 if something failed, 2 on usage errors.")
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="a prompt file or a directory of them")
    parser.add_argument("--api-key", default=None,
                        help="tenant key (default: $KVGATE_API_KEY, else DATA_DIR/dev-api-key "
                             "for a gateway on this machine)")
    parser.add_argument("--data-dir", type=Path, default=Path("data"),
                        help="where `kvgate serve` keeps dev-api-key (default: %(default)s)")
    parser.add_argument("--tenant-key", action="append", default=[], metavar="KEY=TENANT",
                        help="the key for entries naming TENANT (repeatable; also "
                             "$KVGATE_API_KEYS, key1=tenantA,key2=tenantB)")
    parser.add_argument("--tag", default=None, metavar="NAME",
                        help="record NAME on the blocks of every prompt warmed, for `kvgate "
                             "admin evict --tag NAME` (1 to 64 of A-Z a-z 0-9 . _ -)")
    add_connection_args(parser)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run_prewarm(args: Any, *, out: TextIO, err: TextIO, env: Mapping[str, str]) -> int:
    """``kvgate prewarm``; returns the exit code."""
    try:
        tenant_to_key = parse_tenant_keys(env.get("KVGATE_API_KEYS", "").split(","))
        tenant_to_key.update(parse_tenant_keys(args.tenant_key))
        admin_key = admin_key_of(args, env, required=False)
        connect = connector(args)
        tag_error = tag_problem(args.tag) if args.tag is not None else None
        if tag_error is not None:
            raise UsageError(f"--tag: {tag_error}")
    except (UsageError, ValueError) as exc:
        err.write(f"kvgate prewarm: {exc}\n")
        return EXIT_USAGE
    api_key = api_key_of(args.api_key, env, host=args.host, data_dir=args.data_dir)
    entries, problems = load_entries(args.paths)
    for problem in problems:
        err.write(f"FAILED {problem.source}: {problem.reason}\n")
    opened: list[KvgateClient] = []

    def open_client(key: str | None) -> KvgateClient:
        client = connect(key)
        opened.append(client)
        return client

    try:
        report = warm_entries(entries, KeyRing(api_key=api_key, admin_key=admin_key,
                                               tenant_to_key=tenant_to_key),
                              open_client, err=err, tag=args.tag)
    except UsageError as exc:
        err.write(f"kvgate prewarm: {exc}\n")
        return EXIT_USAGE
    finally:
        for client in opened:
            client.close()
    report.problems[:0] = problems
    if args.json:
        out.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        write_report(report, out)
    return EXIT_FAILED if report.problems else 0
