"""Which blocks exist and where. Two rooms, the second built on the first (each imports only
itself and the room below it):

- ``operations/``: the cache as it is run and operated -- opened from its config (``factory``),
  what a restart left in a persistent tier adopted, expired blocks and sessions swept, the
  operator's commands (``admin``: list, evict, pin, quota; ``session_admin``; ``tags``) and the
  eviction stream that carries them to every replica (``invalidation``);
- the modules directly here, the core a request goes through: the radix index, the placement
  (who holds what), the prefix cache that decides (leases, refcounts, pins), the transfers that
  move bytes between tiers, the session registry, the counters, and the ``[cache]`` config.

The rule is checked by ``tests/architecture/test_layers.py``.
"""
