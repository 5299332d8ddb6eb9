"""KV events for routers: what the cache's device and host tiers gain and lose, published in
vLLM's KV-events format (msgpack batches over a ZeroMQ PUB socket, with a replay socket).

``wire`` mirrors vLLM's event structs and turns a kvgate block into one; ``publisher`` is the
``gateway.cache.base.TierEvents`` observer that queues them and sends them from a thread of its
own. docs/operations.md, "KV events", says what a router sees and what it cannot.
"""
