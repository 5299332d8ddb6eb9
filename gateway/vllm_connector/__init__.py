"""vLLM as a model worker behind kvgate: kvgate's tiers as vLLM's KV store, through vLLM's
KV-connector interface (issue 49; docs/vllm-worker.md).

vLLM's API server imports a connector's module while it builds its config, so the package
imports nothing on import. ``connector`` is the class vLLM loads and the only module importing
vLLM; the rest are plain, typed modules, tested without it: ``deployment`` (settings, checks,
namespaces), ``planning`` and ``known_keys`` (the scheduler's decisions and its view of the
worker's keys, with ``remote_keys`` for Redis), ``orders`` (what crosses between vLLM's
processes), ``worker_cache`` and ``pages`` (the worker's cache and vLLM's pages),
``key_changes`` and ``worker_admin`` (keys leaving the cache, operators' evictions),
``scope_tag`` and ``page_layout`` (the signed scope, the layout's namespace).
"""
