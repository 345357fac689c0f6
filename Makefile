# Two commands set everything up: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: demo test test-all bench bench-goodput lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, from the CPU wheel: a plain `torch` requirement resolved later would pull CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q --durations=15

test-all: $(STAMP)
	$(PY) -m pytest -q

# The [bench] extra (torchft) after torch and the package: it must not pick its own torch.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

# Benchmarks: each writes bench/results/<name>.json; bench/summary.py writes the table at the
# top of docs/performance.md from them. Under 25 minutes on 2 cores (docs/performance.md,
# "Running the benchmarks", says where the time goes): stall and recovery 2 runs at 64 and
# 256 MiB, one at 1 GiB (the failure cost 3), memory and dedup one run, the torchrun, hosts,
# Ray and reshard comparisons one run each; the planner its worst case (shrink) only.
bench: $(BENCH_STAMP)
	$(PY) bench/ceilings.py --runs 3
	$(PY) bench/replication.py
	$(PY) bench/cpu.py
	$(PY) bench/tls.py
	$(PY) bench/stall.py --runs 2 --large-runs 1
	$(PY) bench/cadence.py --runs 10
	$(PY) bench/recovery.py --runs 2 --large-runs 1 --cost-runs 3
	$(PY) bench/memory.py --runs 1
	$(PY) bench/reshard.py --runs 1
	$(PY) bench/flush.py
	$(PY) bench/torchrun.py --sizes 256 --runs 1
	$(PY) bench/hosts.py --runs 1
	$(PY) bench/ray_recovery.py --runs 1
	$(PY) bench/planner.py --runs 3 --cases shrink
	$(PY) bench/coordinator.py --steps 25
	$(PY) bench/summary.py

# Goodput under a fault every 20 s (ETTR: peerckpt twice, torchft, a DCP restart): about 40 minutes
# more, so not part of `make bench` (kept under 25 minutes); the table picks its JSON up.
bench-goodput: $(BENCH_STAMP)
	$(PY) bench/goodput.py
	$(PY) bench/summary.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
