"""The OpenAI-compatible HTTP front: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` and ``/health`` over Starlette and uvicorn, served by the gRPC service's engine,
keys, limits and metrics (built beside it by ``gateway.service.assembly``)."""
