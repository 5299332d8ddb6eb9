"""Canonical token ids: one compact, immutable array type for the whole request path.

Token ids are held as a 1-D little-endian uint32 numpy array from the moment they are
produced. Fingerprinting hashes slices of its buffer directly (no per-token Python work: turning
an 8,192-token list into an array costs ~100 µs, hashing its 32 blocks ~40 µs), the index keeps
block tokens as bytes of the same layout, and the model worker can view it as a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

TokenIds = npt.NDArray[np.uint32]
"""1-D, dtype ``<u4`` (little-endian uint32), read-only."""

TOKEN_DTYPE = np.dtype("<u4")
BYTES_PER_TOKEN = TOKEN_DTYPE.itemsize


def as_token_ids(ids: Sequence[int] | npt.NDArray[np.integer]) -> TokenIds:
    """Return ``ids`` as a read-only little-endian uint32 array (no copy if already one).

    Raises:
        ValueError: an id is negative or does not fit in 32 bits, or ``ids`` is not 1-D.
    """
    if isinstance(ids, np.ndarray) and ids.dtype == TOKEN_DTYPE and ids.ndim == 1:
        if not ids.flags.writeable:
            return cast(TokenIds, ids)
        out = ids.copy()
    else:
        wide = np.asarray(ids, dtype=np.int64)
        if wide.ndim != 1:
            raise ValueError(f"token ids must be a flat sequence, got shape {wide.shape}")
        if wide.size and (wide.min() < 0 or wide.max() > 0xFFFF_FFFF):
            raise ValueError("token ids must be integers in [0, 2**32)")
        out = wide.astype(TOKEN_DTYPE)
    out.flags.writeable = False
    return cast(TokenIds, out)


def token_view(ids: TokenIds) -> memoryview:
    """A zero-copy byte view of ``ids`` (little-endian uint32s)."""
    return memoryview(ids.data).cast("B")


def token_bytes(ids: TokenIds) -> bytes:
    """The little-endian bytes of ``ids``: the form that is hashed and stored."""
    return ids.tobytes()


def tokens_from_bytes(data: bytes) -> TokenIds:
    """Inverse of ``token_bytes`` (read-only view over ``data``)."""
    if len(data) % BYTES_PER_TOKEN:
        raise ValueError(f"token bytes must be a multiple of {BYTES_PER_TOKEN}, got {len(data)}")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)
