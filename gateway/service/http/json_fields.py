"""Typed reads of a JSON request body's fields, shared by the OpenAI and Anthropic requests.

JSON has one number type and Python two (and ``bool`` is an ``int``): these say what a field
must be in the words a client reads (``must be an integer, got 1.5``) and never take ``true``
for 1. A field sent as ``null`` counts as not sent, as both hosted APIs treat it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gateway.service.http.errors import InvalidParam


def optional_field(fields: Mapping[str, Any], name: str, kind: type, words: str, *,
                   where: str | None = None) -> Any:
    """``fields[name]`` if it is of ``kind`` (an int counts as a float), None if absent.

    Args:
        fields: the object the field is read from.
        name: its key there.
        kind: ``bool``, ``int`` or ``float`` (a finite number, returned as a float).
        words: what the field must be, for the error (``"an integer"``).
        where: the field's path in the body, when it is not ``name`` (``kvgate.ttl_s``).

    Raises:
        InvalidParam: present and not of ``kind``.
    """
    value = fields.get(name)
    if value is None:
        return None
    is_kind = (isinstance(value, bool) if kind is bool
               else is_int(value) if kind is int
               else is_number(value) and math.isfinite(value))
    if not is_kind:
        raise InvalidParam(where or name, f"`{where or name}` must be {words}, got {value!r}")
    return float(value) if kind is float else value


def is_int(value: object) -> bool:
    """A JSON integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A JSON number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_name(value: object) -> str:
    """What a JSON value is, in words (``an object``, ``a list``, ``null``)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value),
                                                                        type(value).__name__)
