#!/bin/bash
# dev/cuda/build_check_bwd.sh NAME ["EXTRA NVCC FLAGS"] [TREE]: dev/cuda/check_bwd.cu linked with
# every CUDA kernel file of TREE (default this working tree; e.g. a worktree at a baseline
# commit), sm_90a only, -lineinfo, into this tree's .devbin_bwd/check_bwd_NAME.xz for
# dev/cuda/run_rev.sh and run_ab_bwd.sh (carry [".devbin_bwd"]). Objects are kept in
# /tmp/fq_check_bwd_obj (one folder per tree and flags) and rebuilt only where the source
# (or a header of csrc/) is newer. Prints each kernel file's C7512 warnings and spills
# (-Xptxas -v), e.g. -DFQ_REV_TRACE for a traced build (name it t*).
set -e
cd "$(dirname "$0")/../.."
OUTBIN=$PWD/.devbin_bwd
name=$1; flags=${2:-}; tree=$(cd "${3:-.}" && pwd)
NV="nvcc -std=c++17 -O3 -lineinfo --use_fast_math -gencode arch=compute_90a,code=sm_90a $flags"
D=/tmp/fq_check_bwd_obj/$(echo "$tree $flags" | md5sum | cut -c1-8); mkdir -p "$D" "$OUTBIN"
cd "$tree"
newest_hdr=$(ls -t csrc/*.h csrc/cuda/*.cuh | head -1)
build() { # src obj extra
    if [ ! -e "$2" ] || [ "$1" -nt "$2" ] || [ "$newest_hdr" -nt "$2" ]; then
        $NV -Icsrc -Xptxas -v $3 -c "$1" -o "$2" 2>&1 | grep -E "error|C7512|spill" | grep -v " 0 bytes spill" | sed "s|^|$(basename "$1"): |" | head -6 || true
        [ -e "$2" ] || { echo "build_check_bwd.sh: $1 failed"; exit 1; }
    fi
}
export -f build; export NV newest_hdr
ls csrc/cuda/gdn_cuda_*.cu | xargs -P "$(nproc)" -I{} bash -c "build {} $D/\$(basename {} .cu).o ''"
build dev/cuda/check_bwd.cu "$D/check_bwd.o" "-Xcompiler -fopenmp"
gcc -std=c11 -O2 -Icsrc -c csrc/gdn_common.c -o "$D/gdn_common.o"
$NV -o "$OUTBIN/check_bwd_$name" "$D"/*.o -lgomp
rm -f "$OUTBIN/check_bwd_$name.xz"; xz -T2 -6 "$OUTBIN/check_bwd_$name"
echo "built .devbin_bwd/check_bwd_$name.xz (from $tree)"
