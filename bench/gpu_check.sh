#!/usr/bin/env bash
# The GPU checks in one command (`make test-gpu` runs it; it needs no make): what the device
# is, then tests/gpu and bench/gpu.py --nccl, each run whatever the other did, so that one
# try on a lent GPU machine yields both; the exit status is the first failure's. With $OUT
# set (the device tool's folder of files to bring back), the log and the results go there.
set -u
PY=${GPU_PY:-python3}
OUTDIR=${OUT:-}
cd "$(dirname "$0")/.."
log() { if [ -n "$OUTDIR" ]; then tee -a "$OUTDIR/gpu-check.log"; else cat; fi; }
{
  date -u
  nvidia-smi -L || echo "nvidia-smi: not found"
  df -h /dev/shm
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | log
"$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --no-compile .whl/*.whl -e . 2>&1 | log
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || exit "$status"
export PYTHONUNBUFFERED=1
# A test that hangs is cut at 120 s and the tests at 280 s together, not at the device call's
# limit: the bench still runs, and writes each part as soon as it has it (GPU_BENCH_S caps it).
timeout -k 5 "${GPU_TESTS_S:-280}" "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider \
  --timeout 120 2>&1 | log
tests=${PIPESTATUS[0]}
timeout -k 5 "${GPU_BENCH_S:-240}" "$PY" bench/gpu.py --nccl --runs 1 --steps 24 2>&1 | log
bench=${PIPESTATUS[0]}
if [ -n "$OUTDIR" ] && [ -f bench/results/gpu-nccl.json ]; then
  cp bench/results/gpu-nccl.json bench/results/gpu.json "$OUTDIR"/ 2>/dev/null
fi
echo "tests/gpu exit $tests, bench/gpu.py exit $bench" | log
[ "$tests" -ne 0 ] && exit "$tests"
exit "$bench"
