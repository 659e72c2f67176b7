#!/bin/bash
# Build and run dev/cuda/check_fwd.cu on a GPU machine (from the repo root):
# full check of the forward (every stage B configuration) + timings,
# then in parallel the compute_80 PTX fallback (forced JIT) and
# compute-sanitizer memcheck (mode tiny: every kernel variant on small
# problems) and racecheck (mode race: fewer, shorter). The summary table of
# the full run is printed last. Logs go to $OUT if set (check_fwd.log,
# jit.log, fwd_memcheck.log, fwd_racecheck.log). About 3-4 minutes on the H200.
#
#   bash dev/cuda/run_check_fwd.sh [full|build|ab]
#     full (default) as above; build: only compile $B/check_fwd;
#     ab: A/B timings, one process per line of FQ_AB_CONFIGS (environment
#     assignments for the library's switches, e.g. $'FLASHQLA_CUDA_PDL=1\n
#     FLASHQLA_CUDA_PDL=0'; default: one run with the defaults; `check_fwd
#     time`), then the quick check and the tiny memcheck/racecheck runs with
#     the defaults.
#     build/ab reuse $B/check_fwd when it exists.
#   FQ_BUILD_DIR: where the objects and $B/check_fwd go (default /tmp/fqbuild).
#   FQ_NVFLAGS: extra nvcc flags for every object (e.g. a -D that a temporary
#     #ifndef in the sources reads: a variant binary to time against the default
#     one in the same device call; benchmarks/NOTES.md, session 7).
set -u
MODE=${1:-full}
OUTDIR=${OUT:-/tmp}; mkdir -p "$OUTDIR"
B=${FQ_BUILD_DIR:-/tmp/fqbuild}; mkdir -p $B
. "$(dirname "$0")/devrun_lib.sh" # (fq_sanitize_pair: memcheck of mode tiny and racecheck of mode race, in parallel)
if [ "$MODE" = ab ] && [ -x $B/check_fwd ]; then
  IFS=$'\n' read -r -d '' -a CFGS <<< "${FQ_AB_CONFIGS:- }"
  for k in "${!CFGS[@]}"; do
    cfg=$(echo ${CFGS[$k]})
    echo "=== ${cfg:-defaults}"
    env $cfg timeout 100 $B/check_fwd time > $OUTDIR/ab_$k.log 2>&1
    grep -E "programmatic|recurrent N" $OUTDIR/ab_$k.log
    sed -n "/==== summary/,\$p" $OUTDIR/ab_$k.log | grep -E "^[0-9]+/|shape"
  done
  echo "=== quick check (defaults)"
  timeout 150 $B/check_fwd quick > $OUTDIR/check_fwd_quick.log 2>&1; rc=$?
  grep -E "FAIL" $OUTDIR/check_fwd_quick.log | head -20
  echo "(exit $rc; $(grep -c ' ok$' $OUTDIR/check_fwd_quick.log) checks ok, $(grep -c 'FAIL' $OUTDIR/check_fwd_quick.log) FAIL lines)"
  grep -E "correctness:" $OUTDIR/check_fwd_quick.log
  fq_sanitize_pair $OUTDIR/fwd 110 $B/check_fwd tiny race
  exit 0
fi
NV="nvcc ${FQ_NVFLAGS:-} -std=c++17 -O3 -lineinfo --use_fast_math -Icsrc -Icsrc/cuda -Idev/cuda -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=compute_80"
gcc -std=c11 -O2 -c csrc/gdn_common.c -o $B/gdn_common.o || exit 1
pids=""
for f in dev/cuda/check_fwd.cu csrc/cuda/gdn_cuda_fwd.cu csrc/cuda/gdn_cuda_fwd_wy.cu csrc/cuda/gdn_cuda_fwd_state.cu \
         csrc/cuda/gdn_cuda_fwd_output.cu csrc/cuda/gdn_cuda_fwd_fused.cu csrc/cuda/gdn_cuda_recurrent.cu csrc/cuda/gdn_cuda_runtime.cu \
         csrc/cuda/gdn_cuda_gates.cu csrc/cuda/gdn_cuda_fwd_checkpoints.cu csrc/cuda/gdn_cuda_commit.cu; do
  $NV -Xptxas -v -c $f -o $B/$(basename $f .cu).o > $B/$(basename $f .cu).log 2>&1 &
  pids="$pids $!"
done
fail=0; for p in $pids; do wait $p || fail=1; done
echo "=== ptxas (sm_90a): registers / spills per kernel"
for f in $B/gdn_cuda_fwd_wy.log $B/gdn_cuda_fwd_state.log $B/gdn_cuda_fwd_output.log $B/gdn_cuda_fwd_fused.log; do
  awk "/Compiling entry function.*sm_90a/ {split(\$0, a, \"'\"); k = a[2]; on = 1}
       on && /spill stores/ {sp = \$5}
       on && /Used [0-9]+ registers/ {print \"  \" k, \$5, \"regs,\", sp, \"B spill\"; on = 0}" $f
done
[ $fail = 0 ] || { cat $B/*.log | grep -B2 -A5 error | head -60; exit 1; }
$NV -o $B/check_fwd $B/check_fwd.o $B/gdn_cuda_fwd.o $B/gdn_cuda_fwd_wy.o $B/gdn_cuda_fwd_state.o \
    $B/gdn_cuda_fwd_output.o $B/gdn_cuda_fwd_fused.o $B/gdn_cuda_recurrent.o $B/gdn_cuda_runtime.o \
    $B/gdn_cuda_gates.o $B/gdn_cuda_fwd_checkpoints.o $B/gdn_cuda_commit.o $B/gdn_common.o || exit 1
[ "$MODE" = build ] && exit 0
[ "$MODE" = ab ] && exec bash "$0" ab
echo "=== full check + timings"
timeout 240 $B/check_fwd > $OUTDIR/check_fwd.log 2>&1; rc=$?
grep -vE " ok$" $OUTDIR/check_fwd.log | sed '/==== summary/,$d'
echo "(exit $rc; $(grep -c ' ok$' $OUTDIR/check_fwd.log) checks ok, $(grep -c 'FAIL' $OUTDIR/check_fwd.log) FAIL lines; full log: check_fwd.log)"
echo "=== compute_80 PTX (forced JIT, tiny), memcheck (tiny), racecheck (race), in parallel"
( CUDA_FORCE_PTX_JIT=1 timeout 110 $B/check_fwd tiny > $OUTDIR/jit.log 2>&1 ) &
j1=$!
fq_sanitize_pair $OUTDIR/fwd 110 $B/check_fwd tiny race
wait $j1
echo "jit:       $(grep -E 'FAIL|passed' $OUTDIR/jit.log | tail -3 | tr '\n' ' ')"
echo "=== summary of the full run"
sed -n '/==== summary/,$p' $OUTDIR/check_fwd.log
exit 0
