# Two commands set everything up: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: demo test test-all test-gpu gpu-wheels bench bench-goodput lint clean

$(STAMP): pyproject.toml setup.py
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

# The GPU checks, on a machine with a CUDA device (CI has none). Prepare here, where PyPI is
# reachable: `make gpu-wheels` downloads, for the GPU image's Python 3.12, the dependencies
# that image lacks (it has CUDA's torch, CuPy, grpcio, msgpack, numpy, ...) into .whl/
# (ignored by git; carried to the device). There, `make test-gpu` (bench/gpu_check.sh, which
# runs without make too) installs them and this
# package, editable as in .venv, into that image's Python (a machine that starts bare each
# time), runs tests/gpu (NCCL ranks sharing the GPU) and bench/gpu.py --nccl
# (bench/results/gpu-nccl.json): 3.5 + 4 minutes on an H200 (2026-11-28). Not a --target folder on
# PYTHONPATH: the tests and benches start `python -m peerckpt.launch` from this folder, whose
# peerckpt/ then shadows the installed package and lacks peerckpt.runtime & co. (mapped from
# runtime/, ...), which only the editable install's finder resolves from here.
GPU_PY ?= python3

gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl \
	  crc32c setproctitle cryptography cffi pycparser torchdata==0.11.0

test-gpu:
	GPU_PY=$(GPU_PY) bash bench/gpu_check.sh

# The [bench] extra (torchft) after torch and the package: it must not pick its own torch.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

# Benchmarks: each writes bench/results/<name>.json; bench/summary.py writes the table at the
# top of docs/performance.md from them. Under 25 minutes on 2 cores (docs/performance.md,
# "Running the benchmarks", says where the time goes): stall and recovery 2 runs at 64 and
# 256 MiB, one at 1 GiB (the failure cost 3), memory and dedup one run, the torchrun, hosts,
# Ray and reshard comparisons one run each; the planner its worst case (shrink) only; the
# control plane at 100, 1,000 and 10,000 ranks (bench/scale.py, about 3 minutes).
bench: $(BENCH_STAMP)
	$(PY) bench/ceilings.py --runs 3
	$(PY) bench/replication.py
	$(PY) bench/cpu.py
	$(PY) bench/tls.py
	$(PY) bench/stall.py --runs 2 --large-runs 1
	$(PY) bench/cadence.py --runs 10
	$(PY) bench/recovery.py --runs 2 --large-runs 1 --cost-runs 3
	$(PY) bench/memory.py --runs 1
	$(PY) bench/erasure.py --runs 1
	$(PY) bench/reshard.py --runs 1
	$(PY) bench/flush.py
	$(PY) bench/torchrun.py --sizes 256 --runs 1
	$(PY) bench/hosts.py --runs 1
	$(PY) bench/ray_recovery.py --runs 1
	$(PY) bench/planner.py --runs 3 --cases shrink
	$(PY) bench/coordinator.py --steps 25
	$(PY) bench/scale.py
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
