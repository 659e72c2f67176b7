#!/bin/bash
# dev/cuda/run_dev.sh: the kernel-development run on the GPU machine (one device call):
# the wgmma wrapper check, the forward checker (quick: correctness of the library's forward
# and of the three-stage configurations, fused stage A against the blocked stage A), the short timing rows,
# and compute-sanitizer memcheck + racecheck on tiny problems. Binaries come from .devbin/
# (built on the development machine: bash dev/cuda/run_dev.sh build; carried with
# carry [".devbin"]) or are built here when missing or not runnable. Summary last.
#
#   bash dev/cuda/run_dev.sh [build|run]      (default run)
set -u
MODE=${1:-run}
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
BIN=.devbin
build() {
    mkdir -p $BIN
    nvcc -std=c++17 -O3 -Icsrc -Icsrc/cuda -Idev/cuda -gencode arch=compute_90a,code=sm_90a \
        -o $BIN/check_wgmma dev/cuda/check_wgmma.cu || return 1
    bash dev/cuda/run_check_fwd.sh build > $OUTDIR/build_check_fwd.log 2>&1 || { tail -40 $OUTDIR/build_check_fwd.log; return 1; }
    cp /tmp/fqbuild/check_fwd $BIN/
}
if [ "$MODE" = build ]; then build; exit $?; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
if ! $BIN/check_wgmma > $OUTDIR/check_wgmma.log 2>&1 && ! grep -q "check_wgmma:" $OUTDIR/check_wgmma.log; then
    echo "carried binaries do not run here ($(head -c 200 $OUTDIR/check_wgmma.log)); building"
    build || exit 1
    $BIN/check_wgmma > $OUTDIR/check_wgmma.log 2>&1
fi
echo "=== wgmma wrappers"; cat $OUTDIR/check_wgmma.log
echo "=== check_fwd quick"
timeout 150 $BIN/check_fwd quick > $OUTDIR/check_fwd_quick.log 2>&1; rc=$?
grep -E "FAIL|stage A|max \|dA" $OUTDIR/check_fwd_quick.log | head -40
echo "(exit $rc; $(grep -c ' ok$' $OUTDIR/check_fwd_quick.log) ok, $(grep -c 'FAIL' $OUTDIR/check_fwd_quick.log) FAIL lines)"
grep -E "ladder|cp |batch|correctness:" $OUTDIR/check_fwd_quick.log
echo "=== memcheck (tiny) and racecheck (race), in parallel"
. dev/cuda/devrun_lib.sh # (after the cd to the repository root)
fq_sanitize_pair "$OUTDIR/fwd" 120 $BIN/check_fwd tiny race
echo "=== timings (short rows)"
timeout 240 $BIN/check_fwd time > $OUTDIR/check_fwd_time.log 2>&1; echo "(exit $?)"
grep -E "^  fwd|recurrent" $OUTDIR/check_fwd_time.log | cut -c1-200
sed -n '/==== summary/,$p' $OUTDIR/check_fwd_time.log
