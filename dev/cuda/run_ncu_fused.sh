#!/bin/bash
# dev/cuda/run_ncu_fused.sh: Nsight Compute on the fused forward's two kernels (stage A
# inverse, fused main) at 16/32 x 8192, clocks untouched; the details page (speed of
# light, warp stalls, scheduler) printed, per-instruction stall samples (SASS) as CSV in
# $OUT for reading on the development machine. Needs .devbin/check_fwd (carry it), or the
# binary FQ_NCU_BIN; FQ_PROF_T / FQ_PROF_B: tokens per sequence (8192) and sequences (1);
# FQ_NCU_TAG: a suffix for the files in $OUT (to profile two binaries in one call).
set -u
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
for k in ${FQ_NCU_KERNELS:-fused inverse}; do
  timeout 200 $NCU --clock-control none -k "regex:fq_fwd_${k}_kernel" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section SourceCounters --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --import-source no -f -o /tmp/ncu_$k${FQ_NCU_TAG:-} ${FQ_NCU_BIN:-.devbin/check_fwd} prof 16 32 ${FQ_PROF_T:-8192} ${FQ_PROF_B:-1} > /tmp/ncu_$k.log 2>&1
  echo "== $k: $(tail -2 /tmp/ncu_$k.log | tr '\n' ' ')"
  t=${k}${FQ_NCU_TAG:-}
  $NCU --import /tmp/ncu_$t.ncu-rep --page details --csv > $OUTDIR/ncu_${t}_details.csv 2>&1
  $NCU --import /tmp/ncu_$t.ncu-rep --page source --csv --print-source sass > $OUTDIR/ncu_${t}_sass.csv 2>&1
  python3 - "$OUTDIR/ncu_${t}_details.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[0] if rows else []
try:
    i_sec, i_name, i_unit, i_val = hdr.index("Section Name"), hdr.index("Metric Name"), hdr.index("Metric Unit"), hdr.index("Metric Value")
except ValueError:
    print("\n".join(",".join(r) for r in rows[:40])); sys.exit()
keep = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "Executed Ipc Active",
        "Issue Slots Busy", "No Eligible", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler",
        "Warp Cycles Per Issued Instruction", "Registers Per Thread", "Achieved Occupancy", "L1/TEX Hit Rate", "L2 Hit Rate",
        "Issued Warp Per Scheduler", "SM Busy")
for r in rows[1:]:
    if len(r) > i_val and any(k in r[i_name] for k in keep):
        print(f"  {r[i_name]:45s} {r[i_val]:>12s} {r[i_unit]}")
PY
done
ls -la $OUTDIR
