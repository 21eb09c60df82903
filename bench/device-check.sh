#!/usr/bin/env bash
# Every GPU-side check in one call, for a lent GPU machine (its own python3 with torch + Triton, no install):
#   verify --device cuda --quick   conformance vs the float64 oracle, determinism, CUDA graphs, torch.compile,
#                                  the MoE shared-expert overlap: stream race check, eager and CUDA-graph
#                                  timings off/on, a profile of an eager call off/on (where eager loses)
#   bench --device cuda --quick    Triton launcher vs eager / compiled unfused reference and a same-size copy
#   the shared suite's cuda rows   tests/test_fuzz.py -k cuda (fresh random geometries, every element checked)
#   qkvfuse_bench.cache_device     the Triton cache-writing split: correctness rows, bandwidth at T=4096/16384
#                                  against a same-size copy, CUDA-graph replay on new slots/positions/scales
#   the bug classes                tests/backends/test_triton_bug_classes.py on CUDA: offsets past 2^31 elements,
#                                  in-place read-after-write, strided [3, T] positions under CUDA-graph replay,
#                                  partial rotary with many heads per program, the cached launch's arguments
#   hostcost                       host time per call at T = 1 with real launches (qkvfuse_bench.hostcost)
# Each step has its own time cap (seconds: VERIFY_S, BENCH_S, TESTS_S, CACHE_S, BUGS_S, HOST_S) so one that
# hangs leaves the others their time (VERIFY_S=0 skips verify; BENCH_ARGS adds bench flags, e.g. --tile-sweep);
# logs and JSON go to $OUT
# (default /tmp/qkvfuse-device). Usage, from the repository root:
#   bash bench/device-check.sh
set -u
OUT=${OUT:-/tmp/qkvfuse-device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/env.txt"
$PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/env.txt"

step() {  # step NAME SECONDS COMMAND...: run with a cap, log to $OUT/NAME.log, print the exit status
    local name=$1 cap=$2 t0=$SECONDS
    shift 2
    timeout "$cap" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s (cap $cap s)" | tee -a "$OUT/env.txt"
}
[ "${VERIFY_S:-300}" = 0 ] ||
    step verify "${VERIFY_S:-300}" $PY -m qkvfuse verify --device cuda --quick --json "$OUT/verify.json"
step bench "${BENCH_S:-150}" $PY -m qkvfuse bench --device cuda --quick --json "$OUT/bench.json" ${BENCH_ARGS:-}
XDIST=$($PY -c "import xdist; print('-n 8')" 2>/dev/null)
step tests "${TESTS_S:-110}" $PY -m pytest -q $XDIST -k cuda \
    tests/test_fuzz.py
step cache "${CACHE_S:-120}" env PYTHONPATH="$PWD/bench:$PYTHONPATH" $PY -m qkvfuse_bench.cache_device \
    --json "$OUT/cache.json"
step bugclasses "${BUGS_S:-150}" $PY -m pytest -q tests/backends/test_triton_bug_classes.py
step hostcost "${HOST_S:-60}" env PYTHONPATH="$PWD/bench:$PYTHONPATH" $PY -m qkvfuse_bench.hostcost --device cuda \
    --json "$OUT/hostcost.json"

# The reply shows the end of the output: the summaries last.
grep -E "FAIL|Error|error" "$OUT/verify.log" | head -20
grep -A 12 "^== moe-shared-expert-overlap" "$OUT/verify.log" | cut -c 1-400  # timings and the eager profile
tail -n 25 "$OUT/bench.log"
tail -n 8 "$OUT/tests.log"
grep -E "^FAIL" "$OUT/cache.log"; tail -n 9 "$OUT/cache.log"
tail -n 6 "$OUT/bugclasses.log"
tail -n 20 "$OUT/hostcost.log"
tail -n 3 "$OUT/verify.log"
cat "$OUT/env.txt"
