"""The engine and cache admin the gRPC services call, attached once the model has loaded.

The server listens before the model is loaded (health says NOT_SERVING meanwhile), so the
servicers hold a slot that is empty until the composition root attaches the engine; a call
that arrives before then gets UNAVAILABLE with a message saying why.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from gateway.core.errors import EngineDraining, InvalidRequest

if TYPE_CHECKING:
    from gateway.cache.operations.admin import CacheAdmin
    from gateway.engine.engine import Engine


class EngineSlot:
    """The engine and cache admin the services call; empty while the model loads (UNAVAILABLE)."""

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._admin: CacheAdmin | None = None
        self._lock = threading.Lock()

    def attach(self, engine: Engine, admin: CacheAdmin | None) -> None:
        """Serve ``engine`` and ``admin`` (None: the server runs without a cache)."""
        with self._lock:
            self._engine = engine
            self._admin = admin

    def get(self) -> Engine:
        """The engine.

        Raises:
            EngineDraining: no engine yet: the model is still loading.
        """
        with self._lock:
            engine = self._engine
        if engine is None:
            raise EngineDraining("the gateway is still loading its model; retry in a few seconds")
        return engine

    def admin(self) -> CacheAdmin:
        """The cache's admin operations.

        Raises:
            EngineDraining: the model is still loading.
            InvalidRequest: the server runs without a cache.
        """
        self.get()  # the admin is attached with the engine, under the lock
        if self._admin is None:
            raise InvalidRequest("this server runs without a cache")
        return self._admin
