#!/bin/bash
# dev/cuda/run_ab_beside_build.sh: run_ab_bwd.sh's checks started at once, beside gpu_check.sh's
# build (which needs no GPU), so that one short device call holds the A/B and the GPU suite:
#
#   device:  bash dev/cuda/run_ab_beside_build.sh [gpu_check.sh options]
#            (carry [".devbin_bwd", ".devwheels"]; environment as for gpu_check.sh, e.g.
#             FQ_COMMIT, FQ_PYTEST_WORKERS, FQ_TOTAL_BUDGET; FQ_AB_ENV as in run_ab_bwd.sh;
#             FQ_CALL_LIMIT: seconds the whole script may take, default 560)
#
# In the background, in this order: B's full check (check_bwd_b: every case against the float64
# reference, then its timings), A's, B's again and every check_bwd_[c-z]'s timings (and B's under
# FQ_AB_ENV), then a marker; then B's full check with bwd_rev90 forced, B's small cases with
# FLASHQLA_CUDA_BWD_SM90=0, and memcheck + racecheck of B's small cases on both paths. The GPU
# suite (gpu_check.sh, its pre-command waiting for the marker) starts only after the timings, so
# they run with the GPU to themselves; the rest overlaps the suite. Logs in /tmp/ab, returned as
# $OUT/ab.tar.xz; the console of the checks as $OUT/ab_console.log, printed last.
set -u
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/ab
cd "$(dirname "$0")/../.." || exit 1
. dev/cuda/devrun_lib.sh
B=/tmp/fq_ab_bwd_bin
fq_unpack_bins .devbin_bwd $B
rm -f /tmp/ab/timed
T0=$(date +%s)
ab() {
    local L=/tmp/ab x
    export OMP_NUM_THREADS=$(nproc)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
    echo "=== B: full check + timings"
    timeout 150 $B/check_bwd_b > $L/check_b.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
    grep -E "FAIL|error|capture" $L/check_b.log | head -20
    grep -E "ALL OK|failures" $L/check_b.log | tail -2
    for x in a b $(ls $B | grep -E '^check_bwd_[c-z]$' | sed 's/check_bwd_//'); do
        timeout 90 $B/check_bwd_$x time > $L/time_$x.log 2>&1; echo "(time $x: exit $? at $(( $(date +%s) - T0 )) s)"
    done
    if [ -n "${FQ_AB_ENV:-}" ]; then
        env $FQ_AB_ENV timeout 90 $B/check_bwd_b time > $L/time_benv.log 2>&1; echo "(B with $FQ_AB_ENV: exit $?)"
    fi
    touch $L/timed
    echo "=== B: full check with bwd_rev90 forced"
    FLASHQLA_CUDA_BWD_REVERSE=1 timeout 150 $B/check_bwd_b > $L/check_brev.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
    grep -E "FAIL|error|capture" $L/check_brev.log | head -20
    grep -E "ALL OK|failures" $L/check_brev.log | tail -2
    if ! grep -q "ALL OK" $L/check_b.log && [ -x $B/check_bwd_c ]; then
        echo "=== c: full check (B failed)"
        timeout 150 $B/check_bwd_c > $L/check_c.log 2>&1; grep -E "ALL OK|FAIL" $L/check_c.log | head
    fi
    echo "--- B small, FLASHQLA_CUDA_BWD_SM90=0"
    FLASHQLA_CUDA_BWD_SM90=0 timeout 60 $B/check_bwd_b small 2>&1 | tail -4
    echo "=== B memcheck and racecheck, small: default paths, then bwd_rev90 forced"
    (export FLASHQLA_CUDA_BWD_REVERSE=1; fq_sanitize_pair $L/san_rev 120 $B/check_bwd_b small small > $L/san_rev.txt) &
    fq_sanitize_pair $L/san 120 $B/check_bwd_b small small
    wait
    cat $L/san_rev.txt
    echo "=== per row (ms): total rec loc st wy, at $(( $(date +%s) - T0 )) s"
    for x in check_b time_a time_b $(cd $L && ls time_[c-z].log time_benv.log 2>/dev/null | sed 's/.log$//'); do
        echo "--- $x"; sed -n '/^shape /,/^$/p' $L/$x.log | grep -v "^$" | head -8
    done
}
ab > "$OUT/ab_console.log" 2>&1 &
ABPID=$!
FQ_PRE_CMD='for i in $(seq 1 280); do [ -f /tmp/ab/timed ] && break; sleep 1; done; echo "timings done (waited ${i} s)"' \
    bash dev/gpu_check.sh "$@"
# (the checks get what is left of FQ_CALL_LIMIT, default 560 s, less 15 for the packing)
while kill -0 $ABPID 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt $(( ${FQ_CALL_LIMIT:-560} - 15 )) ]; do sleep 1; done
kill $ABPID 2>/dev/null
tar -cJf "$OUT/ab.tar.xz" -C /tmp ab
echo; echo "=== the checks beside (ab_console.log) ==="; cat "$OUT/ab_console.log"
