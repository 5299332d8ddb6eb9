"""``kvgate explain``: why a prompt does not reuse an earlier request's cached prefix.

It asks a running gateway over gRPC ``Lookup`` with ``previous_request_id`` (nothing is
computed), so the gateway's one diagnosis (``gateway.service.miss_diagnosis``, the same the
HTTP routes' ``cache_miss_reason`` and ``prompt_cache_diagnostics`` come from) answers, and
prints it for a person, or as JSON with ``--json``. The earlier request is named by the id the
gateway gave it: a ``/v1/messages`` id (of a request that sent ``diagnostics``), a
``/v1/responses`` id, or a gRPC Generate's ``usage.request_id``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from gateway.cli.common import EXIT_FAILED, EXIT_USAGE, api_key_of, printable, read_messages
from gateway.client import DEFAULT_HOST, DEFAULT_PORT, KvgateClient, KvgateError
from gateway.core.requests import LookupResult, PromptComparison

_PARTS = {
    "model": "the model",
    "prompt_cache_key": "the prompt_cache_key",
    "tools": "the tool definitions",
    "system": "the system messages (instructions)",
}


def add_explain_parser(sub: Any) -> None:
    explain = sub.add_parser(
        "explain", help="say why a prompt does not reuse an earlier request's cached prefix",
        description="Compares a prompt with an earlier request the gateway kept (by its id: "
                    "msg_... from /v1/messages with diagnostics, resp_... from /v1/responses, "
                    "gen_... from a gRPC Generate) and prints which part changed, the first "
                    "block that differs and the cached tokens that costs, then what the "
                    "cache holds of the prompt now. Nothing is computed.")
    explain.add_argument("prompt", nargs="?", default=None,
                         help="a last user message, appended to --messages' conversation")
    explain.add_argument("--previous", required=True, metavar="ID",
                         help="the earlier request's id (msg_..., resp_... or gen_...)")
    explain.add_argument("--messages", type=Path, default=None,
                         help="a JSON file: a list of {role, content}, or {messages, tools}")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    explain.add_argument("--host", default=DEFAULT_HOST,
                         help="the gateway's address (default: %(default)s)")
    explain.add_argument("--port", type=int, default=DEFAULT_PORT,
                         help="its gRPC port, [server] port (default: %(default)s; not the "
                              "HTTP API's)")
    explain.add_argument("--api-key", default=None,
                         help="API key of the tenant that made the earlier request (default: "
                              "$KVGATE_API_KEY, else DATA_DIR/dev-api-key for a gateway on "
                              "this machine)")
    explain.add_argument("--data-dir", type=Path, default=Path("data"),
                         help="where `kvgate serve` keeps dev-api-key (default: %(default)s)")
    explain.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    explain.add_argument("--tls", action="store_true", help="connect with TLS")
    explain.add_argument("--ca-cert", type=Path, default=None,
                         help="PEM of the CA that signed the gateway's certificate")


def run_explain(args: argparse.Namespace, *, out: TextIO, err: TextIO,
                env: Mapping[str, str]) -> int:
    """Ask the gateway and print its answer; the exit status (2: a bad command line or file, 1:
    the gateway refused or could not be reached)."""
    try:
        messages, tools = read_messages(args.messages)
    except (OSError, ValueError) as exc:
        err.write(f"kvgate explain: --messages {args.messages}: {exc}\n")
        return EXIT_USAGE
    if args.prompt is not None:
        messages = [*(messages or []), {"role": "user", "content": args.prompt}]
    if not messages:
        err.write("kvgate explain: give the prompt to compare: a PROMPT, --messages FILE, or "
                  "both\n")
        return EXIT_USAGE
    api_key = api_key_of(args.api_key, env, host=args.host, data_dir=args.data_dir)
    root_certificates = args.ca_cert.read_bytes() if args.ca_cert is not None else None
    try:
        with KvgateClient(args.host, args.port, api_key, tls=args.tls,
                          root_certificates=root_certificates, timeout_s=args.timeout) as client:
            result = client.lookup(messages=messages, tools=tools,
                                   previous_request_id=args.previous)
    except (KvgateError, ValueError) as exc:
        err.write(f"kvgate explain: {exc}\n")
        return EXIT_FAILED
    if args.json:
        out.write(json.dumps(as_json(args.previous, result), sort_keys=True) + "\n")
    else:
        out.write("".join(line + "\n" for line in explanation(args.previous, result)))
    return 0


def as_json(previous: str, result: LookupResult) -> dict[str, object]:
    """``--json``'s object: the comparison and the lookup, with the gRPC fields' names."""
    lookup = {field.name: getattr(result, field.name) for field in dataclasses.fields(result)
              if field.name != "comparison"}
    comparison = (dataclasses.asdict(result.comparison) if result.comparison is not None
                  else None)
    return {"previous_request_id": previous, "comparison": comparison, "lookup": lookup}


def explanation(previous: str, result: LookupResult) -> list[str]:
    """The lines a person reads: the comparison, then what the cache holds now."""
    return [*_compared(previous, result.comparison), _cached_now(result)]


def _compared(previous: str, found: PromptComparison | None) -> list[str]:
    name = printable(previous)
    if found is None or not found.previous_known:
        return [f"{name}: previous request unknown (another tenant's, never made, or "
                "forgotten: the gateway keeps the last 1,000 per tenant, each an hour after "
                "its last use, in its own memory)"]
    if found.changed_part is None:
        return [f"compared with {name}: nothing changed: this prompt repeats it or only "
                "appends turns to it",
                f"  {name} left {found.previous_cached_tokens} tokens in the cache; this "
                "prompt can read all of them"]
    if found.changed_part == "messages":
        what = (f"message {found.first_changed_message} after the system messages (edited, "
                "dropped or reordered)")
    else:
        what = _PARTS.get(found.changed_part, found.changed_part)
    block = found.first_differing_block
    return [f"compared with {name}: {what} changed",
            f"  first block that differs: {block} ({found.common_tokens} tokens before the "
            "changed part are the same)",
            f"  {name} left {found.previous_cached_tokens} tokens in the cache; this prompt "
            f"cannot read {found.missed_tokens} of them"]


def _cached_now(result: LookupResult) -> str:
    tiers = ",".join(f"{tier}:{n}" for tier, n in sorted(result.cached_tokens_by_tier.items()))
    line = (f"cached now: {result.cached_tokens} of {result.prompt_tokens} prompt tokens "
            f"({tiers or '-'}) in {result.num_prompt_blocks} full blocks")
    if result.diverges_at_block is None:
        return line + "; every full block is cached"
    return (line + f"; the first block not cached is {result.diverges_at_block}, around "
            f"\"{printable(result.text_around_divergence)}\"")
