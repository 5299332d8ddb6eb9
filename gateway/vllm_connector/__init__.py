"""vLLM as a model worker behind kvgate, through vLLM's KV-connector interface (issue 49;
docs/vllm-worker.md says what is built and what is planned).

vLLM's API server imports a connector's module while it builds its config, so the package
imports nothing on import, and no module here imports vLLM: the pieces are plain, typed modules,
testable without it (``scope_tag``: the tenant a request reaches vLLM with, signed by the
gateway; ``page_layout``: the namespace of a vLLM page layout; ``pages``: vLLM's pages copied
into kvgate's pool and back). The connector class that vLLM loads is not built yet.
"""
