"""The cache as it is run and operated, on top of the core in ``gateway/cache/``: opening it
from its config and starting its threads (``factory``), re-indexing what a persistent tier kept
over a restart (``adoption``), the sweeper that drops expired blocks and sessions, and what an
operator asks of it -- listing, eviction here and in Redis, pins, quotas, tags, sessions
(``admin``, ``remote_eviction``, ``session_admin``, ``tags``) -- with the
eviction stream that carries those evictions to every replica (``invalidation``).

Nothing on a request's path needs this room: the core never imports it.
"""
