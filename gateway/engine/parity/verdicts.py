"""Remembered start-up verdicts: the route search's result kept in the data directory, so a
second start on the same machine serves in seconds instead of probing again.

Why keyed by so much (``machine_identity``): a verdict is only as true as the things it was
measured on. The key digests the model's fingerprint, the dtype and device, the search's
settings, torch's version and build (its BLAS and oneDNN versions), the CPU's model and
instruction-set flags (or the GPU's name and capability), and ``NUMERICS_VERSION``, bumped
whenever kvgate's forward computes differently. Anything changed: another file name, and the
search runs again.

Why a MAC: whoever can write the data directory could otherwise name a route the probe never
passed, and warm would no longer equal cold. Each file carries a keyed BLAKE2b tag over its
contents under the deployment secret (as blocks do, ``tiers.codec``); a file that fails it, or
does not parse, is ignored with a warning and the search runs. Files are written to a temporary
name and renamed, so an interrupted start leaves a whole file or none.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.linear.row_products import KERNELS
from gateway.engine.parity.route_search import ATTENTIONS, RouteVerdict, SearchSettings

logger = logging.getLogger(__name__)

NUMERICS_VERSION = 8
"""Bumped whenever the forward, the probe or the search computes differently; part of every
block's namespace too (a block of a build that computed otherwise is never served). 6: the
weights are read into 64-byte-aligned memory of their own (their bits in a product can depend on
their address) and may be packed for oneDNN. 7: the panel kernel is a candidate, tried first
(a verdict remembered before it would never try it)."""

FORMAT = "kvgate-route-verdict/1"


def cpu_identity() -> str:
    """The CPU's model name and instruction-set flags (what decides the kernels' paths): the
    first processor's entry of ``/proc/cpuinfo``; where there is none (not Linux), the
    platform's own name and no flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = " ".join(sorted((fields.get("flags") or fields.get("Features") or "").split()))
    return f"{model} [{flags}]"


def machine_identity(device: torch.device) -> dict[str, str]:
    """What a verdict depends on besides the model and settings."""
    identity = {
        "torch": torch.__version__,
        "torch_build": hashlib.blake2b(torch.__config__.show().encode(),
                                       digest_size=16).hexdigest(),
        "threads": str(torch.get_num_threads()),
        "cpu": cpu_identity(),
        "numerics": str(NUMERICS_VERSION),
    }
    if device.type == "cuda":
        identity["gpu"] = (f"{torch.cuda.get_device_name(device)} "
                           f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    return identity


def verdict_key(*, fingerprint: str, dtype: torch.dtype, device: torch.device,
                settings: SearchSettings, machine: Mapping[str, str] | None = None,
                walk: str = "") -> dict[str, str]:
    """Everything a verdict for this model, dtype, device and settings depends on; ``walk``:
    what the batched forward would walk of the model (its family's features, or why it cannot),
    so that a build whose families read the same weights otherwise searches again."""
    key = {"model": fingerprint, "dtype": str(dtype), "device": device.type, "walk": walk,
           **{f"setting.{k}": str(v) for k, v in asdict(settings).items()},
           **(machine if machine is not None else machine_identity(device))}
    return key


class VerdictStore:
    """Verdicts in ``directory``, one file per key, authenticated under ``secret``.

    Args:
        directory: where the files live (created 0700 on the first save).
        secret: the deployment secret (the MAC key).
    """

    def __init__(self, directory: Path, secret: bytes) -> None:
        self._directory = directory
        self._secret = secret

    def path_for(self, key: Mapping[str, str]) -> Path:
        digest = hashlib.blake2b(json.dumps(dict(key), sort_keys=True).encode(),
                                 digest_size=16).hexdigest()
        return self._directory / f"{digest}.json"

    def load(self, key: Mapping[str, str]) -> RouteVerdict | None:
        """The verdict remembered for ``key``, or None (none, or one that cannot be trusted)."""
        path = self.path_for(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("cannot read the remembered route verdict %s (%s): searching again",
                           path, exc)
            return None
        try:
            document = json.loads(raw)
            body = document["body"]
            tag = bytes.fromhex(document["tag"])
            if not hmac.compare_digest(tag, self._tag(body)):
                raise ValueError("its tag does not match (written under another deployment "
                                 "secret, or altered)")
            fields = json.loads(body)
            if fields.get("format") != FORMAT or fields.get("key") != dict(key):
                raise ValueError("it was made for another key")
            return _verdict_from(fields["verdict"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("ignoring the remembered route verdict %s: %s; searching again",
                           path, exc)
            return None

    def save(self, key: Mapping[str, str], verdict: RouteVerdict) -> None:
        """Remember ``verdict`` for ``key`` (atomically; a failure to write is only logged)."""
        path = self.path_for(key)
        fields = {"format": FORMAT, "key": dict(key), "verdict": _verdict_fields(verdict)}
        body = json.dumps(fields, sort_keys=True)
        document = json.dumps({"body": body, "tag": self._tag(body).hex()}, indent=1)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            self._directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(document)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("cannot remember the route verdict in %s (%s): the next start "
                           "searches again", path, exc)
            tmp.unlink(missing_ok=True)

    def _tag(self, body: str) -> bytes:
        return hashlib.blake2b(body.encode(), key=self._secret[:64], digest_size=32,
                               person=b"kvgate-verdict").digest()


def _verdict_fields(verdict: RouteVerdict) -> dict[str, Any]:
    fields = asdict(verdict)
    fields["padding"] = asdict(verdict.padding) if verdict.padding is not None else None
    fields["wider"] = [[out, in_, asdict(padding)] for (out, in_), padding in verdict.wider]
    return fields


def _verdict_from(fields: Mapping[str, Any]) -> RouteVerdict:
    padding = fields.get("padding")
    verdict = RouteVerdict(
        name=str(fields["name"]), reason=str(fields["reason"]), kernel=str(fields["kernel"]),
        padding=RowPadding(**padding) if padding is not None else None,
        # A verdict remembered before shapes had paddings of their own has none.
        wider=tuple(((int(out), int(in_)), RowPadding(**more))
                    for out, in_, more in fields.get("wider", ())),
        attention=str(fields["attention"]),
        decode_kv_is_prefill_kv=bool(fields["decode_kv_is_prefill_kv"]),
        packed=bool(fields.get("packed", False)),
        seconds=float(fields["seconds"]))
    if verdict.name not in ("batched", "serial"):
        raise ValueError(f"it names no route ({verdict.name!r})")
    if verdict.name == "batched" and (verdict.kernel not in KERNELS or verdict.padding is None
                                      or verdict.attention not in ATTENTIONS):
        raise ValueError("it names a kernel, padding or attention this build does not have")
    return verdict
