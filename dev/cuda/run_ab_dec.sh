#!/bin/bash
# dev/cuda/run_ab_dec.sh: A/B of the recurrent step (decode / verify) between two trees in one
# device call: check_fwd's `rec` mode (the recurrent checks against the float64 reference and
# every timed recurrent row) of A and B, twice each, then compute-sanitizer memcheck and
# racecheck of B's checks, and a table of the timed rows (ms) last. Variants built by hand
# (check_fwd_c.xz, _d, ...: B's tree with other -D flags) run beside A and B, twice each.
#
#   here:   bash dev/cuda/run_ab_dec.sh build BASELINE_TREE   -> .devbin_dec/check_fwd_{a,b}.xz
#           (A from BASELINE_TREE's gdn_cuda_recurrent.cu, B from this tree; every other object,
#           check_fwd.cu's included, from this tree)
#   device: bash dev/cuda/run_ab_dec.sh run                   (carry [".devbin_dec"])
set -u
MODE=${1:-run}
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
BIN=$PWD/.devbin_dec
OBJS="check_fwd gdn_cuda_fwd gdn_cuda_fwd_wy gdn_cuda_fwd_state gdn_cuda_fwd_output gdn_cuda_fwd_fused gdn_cuda_recurrent
      gdn_cuda_runtime gdn_cuda_gates gdn_cuda_fwd_checkpoints gdn_cuda_commit gdn_common"
if [ "$MODE" = build ]; then
    OTHER=${2:?usage: run_ab_dec.sh build BASELINE_TREE}
    NV="nvcc -std=c++17 -O3 -lineinfo --use_fast_math -Icsrc -Icsrc/cuda -Idev/cuda -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=compute_80"
    FQ_BUILD_DIR=/tmp/fqb bash dev/cuda/run_check_fwd.sh build > /tmp/ab_dec_build_b.log 2>&1 || { tail -30 /tmp/ab_dec_build_b.log; exit 1; }
    rm -rf /tmp/fqa && cp -r /tmp/fqb /tmp/fqa
    (cd "$OTHER" && $NV -c csrc/cuda/gdn_cuda_recurrent.cu -o /tmp/fqa/gdn_cuda_recurrent.o) || exit 1
    $NV -o /tmp/fqa/check_fwd $(for o in $OBJS; do echo /tmp/fqa/$o.o; done) || exit 1
    mkdir -p "$BIN"
    for s in a b; do xz -T2 -3 -c /tmp/fq$s/check_fwd > "$BIN/check_fwd_$s.xz"; done
    grep -A3 "fq_recurrent_kernel" /tmp/fqb/gdn_cuda_recurrent.log | grep -E "registers|spill" | sort | uniq -c
    ls -la "$BIN"
    exit 0
fi
RUNBIN=/tmp/fq_ab_dec; mkdir -p $RUNBIN
SIDES=""
for f in "$BIN"/check_fwd_?.xz; do
    s=$(basename "$f" .xz); s=${s#check_fwd_}
    xz -dc "$f" > $RUNBIN/check_fwd_$s && chmod +x $RUNBIN/check_fwd_$s && SIDES="$SIDES $s"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
for k in 1 2; do
    for s in $SIDES; do
        timeout 120 $RUNBIN/check_fwd_$s rec > "$OUTDIR/rec_$s$k.log" 2>&1 || echo "rec $s$k: exit $?"
    done
done
for s in $SIDES; do
    echo "=== $s: $(grep -c ' ok$' "$OUTDIR/rec_${s}1.log") ok, $(grep -c FAIL "$OUTDIR/rec_${s}1.log") FAIL"
    grep FAIL "$OUTDIR/rec_${s}1.log" | head -20
    grep "correctness:" "$OUTDIR/rec_${s}1.log"
done
if [ -z "${FQ_AB_NO_SAN:-}" ]; then
    echo "=== B memcheck and racecheck (rec check), in parallel"
    ( timeout 150 compute-sanitizer --tool memcheck --print-limit 20 $RUNBIN/check_fwd_b rec check > "$OUTDIR/memcheck_b.log" 2>&1 ) &
    j1=$!
    ( timeout 150 compute-sanitizer --tool racecheck --print-limit 20 $RUNBIN/check_fwd_b rec check > "$OUTDIR/racecheck_b.log" 2>&1 ) &
    j2=$!
    wait $j1 $j2
    echo "memcheck:  $(grep -E 'FAIL|ERROR SUMMARY|correctness' "$OUTDIR/memcheck_b.log" | tail -3 | tr '\n' ' ')"
    echo "racecheck: $(grep -E 'FAIL|RACECHECK SUMMARY|ERROR SUMMARY|correctness' "$OUTDIR/racecheck_b.log" | tail -3 | tr '\n' ' ')"
fi
COLS=""; for k in 1 2; do for s in $SIDES; do COLS="$COLS $s$k"; done; done
echo "=== the timed recurrent rows (ms):$COLS"
grep -h "recurrent N=" "$OUTDIR/rec_a1.log" | while read -r line; do
    key=$(echo "$line" | sed 's/:.*//')
    vals=""
    for n in $COLS; do
        vals="$vals $(grep -F "$key:" "$OUTDIR/rec_$n.log" | sed 's/.*: \([0-9.]*\) ms.*/\1/')"
    done
    fl=$(echo "$line" | sed 's/.*floor \([0-9.]*\) ms.*/\1/')
    printf "%-40s %s | floor %s\n" "$key" "$vals" "$fl"
done
