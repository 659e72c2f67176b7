#!/bin/bash
# dev/cuda/run_ab_beside_build.sh: run_ab_bwd.sh's A/B started at once, beside gpu_check.sh's
# build (which needs no GPU), so that one short device call holds the A/B and the GPU suite:
#
#   device:  bash dev/cuda/run_ab_beside_build.sh [gpu_check.sh options]
#            (carry [".devbin_bwd", ".devwheels"]; environment as for gpu_check.sh, e.g.
#             FQ_COMMIT, FQ_PYTEST_WORKERS, FQ_TOTAL_BUDGET, and run_ab_bwd.sh's FQ_AB_*
#             switches, e.g. FQ_AB_REV=1 FQ_AB_REV_SAN=1 FQ_AB_NO_DRIFT=1 FQ_AB_ENV=...;
#             FQ_CALL_LIMIT: seconds the whole script may take, default 560)
#
# The GPU suite (gpu_check.sh, its pre-command waiting for run_ab_bwd.sh's FQ_AB_MARK) starts
# only once the A/B's timings are done, so that they have the GPU to themselves; the A/B's
# later checks (full check with bwd_rev90 forced, sanitizers) overlap the suite. run_ab_bwd.sh's
# logs come back as $OUT/ab.tar.xz, its console as $OUT/ab_console.log, printed last.
# (Session 25: everything in ~190 s on an H100.)
set -u
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rm -rf /tmp/ab && mkdir -p /tmp/ab
T0=$(date +%s)
# (the marker also at the end, should the A/B stop before its timings are done)
( OUT=/tmp/ab FQ_AB_MARK=/tmp/ab/timed bash dev/cuda/run_ab_bwd.sh run; touch /tmp/ab/timed ) > "$OUT/ab_console.log" 2>&1 &
ABPID=$!
FQ_PRE_CMD='for i in $(seq 1 280); do [ -f /tmp/ab/timed ] && break; sleep 1; done; echo "timings done (waited ${i} s)"' \
    bash dev/gpu_check.sh "$@"
# (the A/B gets what is left of FQ_CALL_LIMIT, less 15 s for the packing)
while kill -0 $ABPID 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt $(( ${FQ_CALL_LIMIT:-560} - 15 )) ]; do sleep 1; done
kill $ABPID 2>/dev/null
tar -cJf "$OUT/ab.tar.xz" -C /tmp ab
echo; echo "=== the A/B beside (ab_console.log) ==="; cat "$OUT/ab_console.log"
