#!/bin/bash
# dev/cuda/ncu_decode.sh: kernel durations of the decode step under Nsight Compute, flashqla's
# recurrent kernels (fq_recurrent_kernel, fq_decode_kernel) and FLA 0.6.0's fused_recurrent kernel on the same inputs
# (dev/cuda/prof_decode.py), L2 left warm (--cache-control none) as in back-to-back decode
# steps. Run on the device from the repository root, carry [".peers"] (FLA from site.tar.xz);
# builds the package first (FQ_NCU_NO_BUILD=1: built already, e.g. by gpu_check.sh's build stage
# when run as its FQ_PRE_CMD).   bash dev/cuda/ncu_decode.sh [N ...]   (default: 1 64)
# FQ_NCU_STALLS=1: the warp-state section (stall reasons per issued instruction) instead of the
# metrics.
set -u
[ -d /tmp/peers/fla ] || { mkdir -p /tmp/peers && xz -dc .peers/site.tar.xz | tar xf - -C /tmp/peers; }
export PYTHONPATH=/tmp/peers
[ -n "${FQ_NCU_NO_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -q -e . > /tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
M="--metrics gpu__time_duration.sum,sm__cycles_active.avg,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,launch__grid_size,launch__block_size,launch__registers_per_thread"
G="gpu__|sm__|dram__|lts__|launch__|rror"
if [ -n "${FQ_NCU_STALLS:-}" ]; then
    M="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum,smsp__inst_executed.sum"
    G="stalled|gpu__|inst_executed|rror"
fi
for n in ${@:-1 64}; do
    echo "=== flashqla N=$n"
    ncu --cache-control none --launch-skip 3 --launch-count 1 -k regex:'fq_recurrent|fq_decode' $M \
        python3 dev/cuda/prof_decode.py "$n" kv 1 2>&1 | grep -E "$G"
    echo "=== FLA N=$n"
    FLA_DISABLE_BACKEND_DISPATCH=1 ncu --cache-control none --launch-skip 3 --launch-count 1 -k regex:fused_recurrent \
        $M python3 dev/cuda/prof_decode.py "$n" kv 1 fla 2>&1 | grep -E "$G"
done
