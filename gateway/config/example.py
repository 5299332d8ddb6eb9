"""The commented example configuration that ``kvgate config example`` prints.

It is the file format's documentation for operators (``deploy/kvgate.example.toml`` holds the
same text, and a test keeps the two equal and checks that the example parses), so it lives
apart from the parser that reads it.
"""

from __future__ import annotations

EXAMPLE_CONFIG = """\
# kvgate serve --config kvgate.toml
#
# Every key is optional: what is left out keeps the default shown. Environment variables
# add keys (KVGATE_API_KEYS, KVGATE_ADMIN_KEYS, or files: KVGATE_API_KEYS_FILE, ...) and set
# the deployment secret (KVGATE_DEPLOYMENT_SECRET, hex) and the Redis URL (KVGATE_REDIS_URL or
# KVGATE_REDIS_URL_FILE); --host, --port, --data-dir, --model, --device and --dtype override
# [server], --http-host, --http-port, --no-http and --served-model-name override [http]. Keep
# keys out of this file (key_blake2b digests are fine): from a secret store, as files or env.
# Sizes are bytes or strings such as "512MiB" or "2GB". Every problem is reported at once.

[server]
host = "127.0.0.1"              # a non-loopback host needs TLS (or allow_insecure_remote)
port = 50051
data_dir = "data"               # kv/ (disk tier), models/, secret, dev-api-key
model = "bundled"               # SmolLM2-135M-Instruct, or a transformers checkpoint directory
device = "auto"                 # the model and the device tier: auto (a GPU if any), cpu, cuda:N
dtype = "auto"                  # weights and K/V: auto (bfloat16 on a GPU, float32 on the CPU),
                                #   float32, bfloat16, float16 (slow on the CPU); part of the
                                #   cache namespace: blocks of one dtype never serve another
# tls_cert = "/etc/kvgate/tls.crt"   # PEM; give both or neither
# tls_key = "/etc/kvgate/tls.key"
# allow_insecure_remote = false      # plaintext on a non-loopback host (behind a TLS proxy)
# secret_file = "/etc/kvgate/secret" # default: data_dir/secret, created on first start
# admin_host = "127.0.0.1"           # the Admin service on a listener of its own (a network
# admin_port = 50052                 #   policy then keeps it from the apps); default: on port

[grpc]                          # limits of the gRPC server
max_receive_bytes = 4194304     # bigger requests: RESOURCE_EXHAUSTED before any handler
max_concurrent_streams = 32     # streams one connection may open at once
body_timeout_s = 5.0            # a call must send its request this soon after its headers
handshake_timeout_s = 10.0      # a connection must finish its TLS/HTTP2 handshake this soon
health_threads = 4              # health checks run apart from keyed calls, on their own threads
max_deadline_s = 600.0          # the longest a request may run, whatever its client asks
max_ttl_s = 604800.0            # the longest TTL a request may give its blocks
shutdown_grace_s = 10.0         # on SIGTERM, time for requests in flight to finish

[engine]
max_queue = 64                  # requests waiting for the model; more are refused
default_ttl_s = 3600.0          # TTL of blocks whose request names none
# max_prompt_tokens = 8191      # default: the model's context minus 1
route = "auto"                  # "auto": batched if the start-up probe finds it exact, else serial
linear_kernel = "auto"          # "auto": panels (kvgate's kernel), else oneDNN, else "blas"
pack_weights = true             # weights laid out once for their kernel (panels need it)
step_tokens = 256               # tokens one step computes (decode rows + prefill chunks)
# prefill_step_tokens = 1024    # ... while none decodes (default: 1024 on a CPU, 8192 on a GPU)
max_lone_step_s = 1.0           # ... cut to this long at the measured speed (others wait that long)
max_running = 16                # requests running at once
max_running_per_tenant = 8      # one tenant cannot take the engine
max_queued_per_tenant = 32      # nor the queue: more are refused (RESOURCE_EXHAUSTED)
kv_budget_bytes = "2GiB"        # KV buffers of the running requests, all together
max_kv_share_per_tenant = 0.5   # of it, one tenant's (1.0 when serving one tenant only)
tail_cache_bytes = "256MiB"     # K/V after a conversation's last full block, for its next turn
shadow_fraction = 0.01          # of cache hits, recomputed cold when idle and compared bit for bit;
                                #   a request arriving meanwhile waits up to 64 tokens' compute
                                #   (1.0 doubles idle compute: docs/parity.md)
captured_steps = true           # steps replayed as CUDA graphs (CUDA + Triton attention only)

[limits]                        # per API key, checked on the call's headers, before any work
max_calls = 64                  # calls in flight, all keys (one worker thread each)
max_calls_per_key = 16          # calls one key may have in flight; more: RESOURCE_EXHAUSTED
max_lookups = 8                 # Lookups in flight (they tokenise), all keys
max_lookups_per_key = 4
lookups_per_s = 50.0            # Lookups one key may start per second (bursts of lookup_burst)
lookup_burst = 100
max_warms_per_key = 2           # Warm calls one key may have in flight
max_prompt_chars = 262144       # checked before the chat template is rendered or tokenised
max_messages = 512

[cache]
block_tokens = 64               # tokens per block: the unit of storage and sharing
order = "lru"                   # eviction order of every tier: "lru" or "clock"
write_queue_bytes = "1GiB"      # queued for disk, and for Redis, at most; more is dropped
compression = "raw"             # "raw", "lz4" or "auto"
skip_slow_tiers = true          # a tier slower than recomputing is skipped (false: always load)
reprobe_interval_s = 10.0       # ... but probed once per interval, used again once it is fast
measure_at_start = true         # disk's and Redis's load speed and the recompute speed are
                                #   measured before serving, to judge the first hit too
sweep_interval_s = 5.0          # expired blocks leave every tier (device, host, disk) this often
session_ttl_s = 1800.0          # a session (session_id, X-Session-Id) ends this long after its
                                #   last request: its own blocks and tail leave every tier
max_sessions_per_tenant = 10000 # past it, a tenant's least recently used session ends
# quotas = { tenant-a = "1GiB", tenant-b = "512MiB" }   # per tenant, in every tier
# tenant_quota = { device = "512MiB", host = "1GiB", disk = "2GiB" }  # every other tenant's

# The tiers, fastest first: the device tier always, and first; a tier left out is off. (The
# old keys -- device_bytes, host_bytes, disk_bytes, disk_path, redis_url, quantize, ... -- still
# read, with a deprecation line.)
[[cache.tier]]
kind = "device"                 # where requests read K/V: GPU memory (CPU memory without a GPU)
bytes = "2GiB"

[[cache.tier]]
kind = "host"                   # CPU memory ("quantized_host" with quantize = "int8": lossy)
bytes = "4GiB"
layered_loads = false           # GPU: hits copied layer by layer beside the step (untimed)

[[cache.tier]]
kind = "disk"                   # meant for local NVMe; kept over a restart
bytes = "8GiB"
# path = "/var/lib/kvgate/kv"   # default: data_dir/kv
fsync = true
write_through = true            # new blocks go to disk at once (off the request path)
# quantize = "int8"             # lossy copies (~0.27x the bytes), read only by requests that
                                #   set allow_lossy; their answers say lossy

# [[cache.tier]]                # shared by replicas; always last
# kind = "redis"
# url = "rediss://kvgate:PASSWORD@redis.internal:6379/0"   # or KVGATE_REDIS_URL
# cluster = false
# ttl_s = 3600.0                # the longest a block lives in Redis unused (a shorter ttl_s wins)
# timeout_s = 0.25              # the most a stalled Redis adds to a request
# write_bytes_per_s = "64MiB"   # per tenant: past it, the rest of a chain stays local
# quantize = "int8"             # one lossy format for every lossy tier

[http]                          # the OpenAI-compatible API: http://HOST:PORT/v1
enabled = true                  # same engine, keys, limits and metrics as gRPC; TLS as [server]
host = "127.0.0.1"              # a non-loopback host needs TLS (or allow_insecure_remote)
port = 8000
max_body_bytes = "4MiB"         # bigger request bodies: 413 before they are read
max_connections = 1024          # one more closes the longest-waiting idle one, never a 503;
                                #   at most half the open-file limit (ulimit -n)
max_waiting_connections = 256   # connections without a whole request yet (new or kept alive)
max_pending_bodies_per_tenant = 16   # bodies one tenant may be sending at once (429 past it)
header_timeout_s = 5.0          # a connection must send a request head this soon, or is closed
body_timeout_s = 5.0            # ... and then its whole body (408); no call slot until it has
retry_after_s = 1               # Retry-After of a 429 or 503 answer
metrics = true                  # GET /metrics here: no per-tenant series; open unless
                                #   [metrics] scrape_token_file is set
session_from_user = false       # true: a body's `user` names the session (as X-Session-Id does)
max_stored_responses_per_tenant = 1000   # POST /v1/responses with store, kept in memory here
max_stored_response_chars_per_tenant = 67108864   # ... and their characters, per tenant
# served_model_name = "my-model"  # the model id of /v1/models and responses (a list: aliases
                                #   requests may use too); default: --model's directory name

[metrics]                       # every series, per tenant too: http://HOST:PORT/metrics
enabled = false                 # per-tenant series: operators only
host = "127.0.0.1"
port = 9464
# scrape_token_file = "/run/secrets/kvgate-metrics-token"  # both /metrics (this port's and
                                #   [http]'s) then need `Authorization: Bearer <token>` (401
                                #   otherwise); or KVGATE_METRICS_TOKEN(_FILE). Unset: open,
                                #   and an open /metrics shows each request's prompt size and
                                #   cache hit on a quiet replica (docs/security.md)

[logging]                       # docs/operations.md, "Logs"
access_log = true               # one line per request (logger kvgate.access); never prompts
stats_interval_s = 10.0         # throughput, hit ratio, queue, KV (kvgate.stats); 0: off
json = false                    # both as one JSON object per line

[events]                        # KV events for routers, in vLLM's format (docs/operations.md)
# kv_events_endpoint = "tcp://127.0.0.1:5557"         # off unless set; or "ipc:///run/kvgate/ev"
# kv_events_replay_endpoint = "tcp://127.0.0.1:5558"  # a router that joined late asks here
kv_events_topic = "kv-events"   # routers subscribe by it (llm-d expects "kv@POD@MODEL")
kv_events_buffer = 10000        # batches kept for replay
allow_remote = false            # the events carry prompt token ids: loopback or ipc:// unless true

# API keys: a tenant's key sees only that tenant's cache. Give `key` (the key itself) or
# `key_blake2b` (hex of gateway.config.keys.key_digest(key)) so that the file holds no secret.
# Without any key, serve creates a development key for tenant "default".
# [[api_keys]]
# tenant = "tenant-a"
# key_blake2b = "<hex digest>"
#
# [[admin_keys]]                # the Admin service (stats, evict, pin, quota, flush)
# name = "ops"
# key_blake2b = "<hex digest>"
"""
"""The commented example of ``kvgate config example`` (and ``deploy/kvgate.example.toml``)."""
