#!/bin/bash
# sass_same.sh BEFORE_DIR AFTER_DIR — proves that a source change left the
# machine code of every remaining CUDA kernel unchanged (no GPU needed).
#
# Both directories hold objects NAME.o of the same csrc/cuda/gdn_cuda_*.cu files,
# built with the project flags before and after the change, e.g.
#
#   for f in csrc/cuda/gdn_cuda_*.cu; do
#     nvcc -std=c++17 -O3 -lineinfo --use_fast_math -Icsrc -Xcompiler -fPIC \
#       -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=compute_80 \
#       -c $f -o /tmp/before/$(basename $f .cu).o
#   done
#
# The SASS of each object (cuobjdump -sass, addresses and instruction
# encodings stripped) is split per kernel ("Function :" lines) and every
# kernel of AFTER is compared with the kernel of the same object and name in
# BEFORE. Kernels only in BEFORE are listed as removed (allowed); a kernel
# only in AFTER, or one whose SASS text differs, is a failure (exit 1, with
# the start of the diff). CUOBJDUMP overrides the tool (default: cuobjdump on
# PATH, else the one shipped with triton in /tmp/venv).
set -u
[ $# = 2 ] || { echo "usage: $0 BEFORE_DIR AFTER_DIR" >&2; exit 2; }
BEFORE=$1; AFTER=$2
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo /tmp/venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump)}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

# split_sass OBJ DIR: one file per kernel in DIR (name: md5 of the function
# name; DIR/index lists "md5 name"); a kernel's text runs from its
# "Function :" line to the next one or to the next "Fatbin ... code:" header
split_sass() {
  mkdir -p "$2"
  "$CUOBJDUMP" -sass "$1" 2>/dev/null | sed -E 's@/\*[0-9a-f]{4}\*/@@; s@ +/\* 0x[0-9a-f]+ \*/@@' | grep -v '^\s*$' |
    awk -v dir="$2" '
      /^[ \t]*Fatbin [a-z]+ code:/ { if (out) close(out); out = ""; next }  # trailer: not the kernel
      /Function :/ { name = $0; sub(/.*Function : */, "", name);
                     cmd = "printf %s \"" name "\" | md5sum | cut -c1-32"; cmd | getline h; close(cmd);
                     if (out) close(out); out = dir "/" h; print h, name >> (dir "/index"); }
      out { print > out }'
  touch "$2/index"
}

fail=0; nb=0; na=0; same=0; removed=0
for ob in "$BEFORE"/*.o; do
  n=$(basename "$ob" .o)
  split_sass "$ob" "$WORK/b/$n"
  nb=$((nb + $(wc -l < "$WORK/b/$n/index")))
  if [ ! -f "$AFTER/$n.o" ]; then
    echo "object $n.o: removed ($(wc -l < "$WORK/b/$n/index") kernels)"
    removed=$((removed + $(wc -l < "$WORK/b/$n/index"))); continue
  fi
  split_sass "$AFTER/$n.o" "$WORK/a/$n"
  na=$((na + $(wc -l < "$WORK/a/$n/index")))
  while read -r h name; do
    if ! grep -q "^$h " "$WORK/a/$n/index"; then
      echo "removed  $n: $name"; removed=$((removed + 1))
    elif cmp -s "$WORK/b/$n/$h" "$WORK/a/$n/$h"; then
      same=$((same + 1))
    else
      echo "CHANGED  $n: $name"; diff "$WORK/b/$n/$h" "$WORK/a/$n/$h" | head -20; fail=1
    fi
  done < "$WORK/b/$n/index"
  while read -r h name; do
    grep -q "^$h " "$WORK/b/$n/index" || { echo "NEW      $n: $name"; fail=1; }
  done < "$WORK/a/$n/index"
done
for oa in "$AFTER"/*.o; do
  n=$(basename "$oa" .o)
  [ -f "$BEFORE/$n.o" ] || { echo "NEW object $n.o"; fail=1; }
done
echo "kernels: before $nb, after $na; identical $same, removed $removed"
[ $fail = 0 ] && echo "OK: every remaining kernel has identical SASS" || echo "FAIL: SASS differs"
exit $fail
