#!/bin/bash
# dev/cuda/run_ab.sh: A/B timing of two source trees' forward in one device call.
# A is this tree, B another worktree (a branch with a kernel change); both binaries
# are built here, on the development machine, and carried:
#
#   here:    bash dev/cuda/run_ab.sh build /work/wt/<branch> [B_NVFLAGS]   (B may be this tree too)
#            -> .devbin/check_fwd_a, check_fwd_b (check_fwd.cu of each tree), and
#               check_fwd_tl_a, check_fwd_tl_b (the same with -DFQ_FUSED_TIMELINE), xz-compressed
#   device:  bash dev/cuda/run_ab.sh run          (carry [".devbin"])
#
# run: `check_fwd time` of A, B, A, B (drift shows as A vs A), B's quick check against
# the float64 reference, compute-sanitizer memcheck (tiny) and racecheck (race) of B,
# the CTA timelines of A and B; a table of the per-row times (total, stage A, main
# kernel) of both, last. Logs in $OUT. FQ_AB_NO_TL=1 leaves the timelines out (at build: does
# not build them), FQ_AB_NO_SAN=1 the sanitizers; a third binary check_fwd_c.xz in the folder
# (built by hand, e.g. B with another -D, or a branch on B's) is timed and checked beside B.
# FQ_AB_REC=1: the recurrent step only (a kernel change there): `check_fwd rec` (its checks
# against the float64 reference and every timed recurrent row) instead of `time` and `quick`,
# the sanitizers on `rec check`, no timelines, the table of the recurrent rows last, e.g.
#   here:    FQ_AB_BIN=.devbin_dec FQ_AB_NO_TL=1 bash dev/cuda/run_ab.sh build /work/wt/<branch>
#   device:  FQ_AB_BIN=.devbin_dec FQ_AB_REC=1 bash dev/cuda/run_ab.sh run   (carry [".devbin_dec"])
set -u
MODE=${1:-run}
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
BIN=$PWD/${FQ_AB_BIN:-.devbin} # (FQ_AB_BIN: another folder of A/B binaries, e.g. .devbin_dec, so that two pairs travel in one call)
if [ "$MODE" = build ]; then
    OTHER=${2:?usage: run_ab.sh build OTHER_TREE [B_NVFLAGS]}
    BFLAGS=${3:-} # extra nvcc flags for B only (e.g. -DFQ_CP_MIN_CHUNKS=65: a variant of a constant)
    rm -rf "$BIN"; mkdir -p "$BIN"
    for side in a b; do
        tree=$PWD; [ $side = b ] && tree=$OTHER
        for tl in "" _tl; do
            [ -n "$tl" ] && [ -n "${FQ_AB_NO_TL:-}" ] && continue
            flags=""; [ -n "$tl" ] && flags="-DFQ_FUSED_TIMELINE"
            [ $side = b ] && flags="$flags $BFLAGS"
            rm -f /tmp/fqbuild/*.o /tmp/fqbuild/check_fwd
            (cd "$tree" && FQ_NVFLAGS="$flags" bash dev/cuda/run_check_fwd.sh build > /tmp/ab_build_$side$tl.log 2>&1) ||
                { tail -30 /tmp/ab_build_$side$tl.log; exit 1; }
            cp /tmp/fqbuild/check_fwd "$BIN/check_fwd$tl"_$side
            grep -E "inverse_kernelILi128|fused_kernelILi128" /tmp/ab_build_$side$tl.log | sed "s/^/  $side$tl: /"
        done
    done
    xz -T2 -6 "$BIN"/check_fwd_* # (four binaries of 15-20 MB each: the 64 MiB carry holds them compressed)
    ls -la "$BIN"
    exit 0
fi
. dev/cuda/devrun_lib.sh # (after the cd to the repository root)
# unpacked outside the repository (so that .devbin keeps only the compressed copies)
RUNBIN=/tmp/fq_ab_bin
fq_unpack_bins "$BIN" $RUNBIN
BIN=$RUNBIN
REC=${FQ_AB_REC:-}
TIMED=time; CHECK=quick; SAN_MEM=tiny; SAN_RACE=race
[ -n "$REC" ] && TIMED=rec CHECK=rec SAN_MEM="rec check" SAN_RACE="rec check"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
SIDES="a b"; [ -x "$BIN/check_fwd_c" ] && SIDES="a b c"
for k in 1 2; do
    for side in $SIDES; do
        timeout 120 "$BIN/check_fwd_$side" $TIMED > "$OUTDIR/time_${side}$k.log" 2>&1 || echo "$TIMED $side$k: exit $?"
    done
done
for side in ${SIDES#a }; do # (B's, and C's when there is one; `rec`: its first timed run holds the checks)
    S=$(echo "$side" | tr a-z A-Z)
    echo "=== $S $CHECK"
    log="$OUTDIR/quick_$side.log"
    if [ -n "$REC" ]; then log="$OUTDIR/time_${side}1.log"; else
        timeout 150 "$BIN/check_fwd_$side" quick > "$log" 2>&1; echo "(exit $?)"
    fi
    grep -E "FAIL" "$log" | head -20
    echo "($(grep -c ' ok$' "$log") ok, $(grep -c FAIL "$log") FAIL lines)"
    grep -E "correctness:" "$log"
done
if [ -z "${FQ_AB_NO_SAN:-}" ]; then # (FQ_AB_NO_SAN=1: no sanitizer runs, when the device time is short)
    echo "=== B memcheck ($SAN_MEM) and racecheck ($SAN_RACE), in parallel"
    fq_sanitize_pair "$OUTDIR/b" 150 "$BIN/check_fwd_b" "$SAN_MEM" "$SAN_RACE"
fi
for side in a b; do
    # (FQ_AB_NO_TL=1: no timelines, when the call has other work; none with FQ_AB_REC)
    [ -n "${FQ_AB_NO_TL:-}$REC" ] && break
    echo "=== timeline $side"
    timeout 60 "$BIN/check_fwd_tl_$side" timeline 2>&1 | grep -E "timeline|seg|S0|chk0|loop|life" > "$OUTDIR/timeline_$side.log"
    cat "$OUTDIR/timeline_$side.log"
done
COLS=""; for k in 1 2; do for side in $SIDES; do COLS="$COLS $side$k"; done; done
echo "=== the recurrent step (ms; N = 1 rows per step of 100 in a graph):$COLS"
grep -h "recurrent N=" "$OUTDIR/time_a1.log" | while read -r line; do
    key=$(echo "$line" | sed 's/:.*//')
    vals=""
    for n in $COLS; do vals="$vals $(grep -F "$key:" "$OUTDIR/time_$n.log" | sed 's/.*: \([0-9.]*\) ms.*/\1/')"; done
    printf "%-48s %s | floor %s\n" "$key" "$vals" "$(echo "$line" | sed 's/.*floor \([0-9.]*\) ms.*/\1/')"
done
[ -n "$REC" ] && exit 0 # (no forward rows)
echo "=== per row (ms): total / stage A (inverse) / main kernel, each run"
python3 - "$OUTDIR" <<'PY'
import os, sys
d = sys.argv[1]
def rows(path):
    out, on = {}, False
    for line in open(path):
        if line.startswith("shape (ms)"):
            on = True
            continue
        if on and "|" in line:
            a, b, c, *_ = line.split("|")
            toks = a.split()
            n = 0
            while n < len(toks):
                try:
                    float(toks[n])
                    break
                except ValueError:
                    n += 1
            shape = " ".join(toks[:n])
            tot = float(b.split()[0]); inv, fused = (float(x) for x in c.split()[:2])
            out[shape] = (tot, inv, fused)
        elif on:
            on = False
    return out
runs = [(n, rows(os.path.join(d, f"time_{n}.log"))) for n in ("a1", "b1", "c1", "a2", "b2", "c2")
        if os.path.exists(os.path.join(d, f"time_{n}.log"))]
shapes = [s for s in runs[0][1]] if runs else []
print(f"{'row':18s} " + " ".join(f"{n:>20s}" for n, _ in runs) + "   B/A total")
for s in shapes:
    cells = [" / ".join(f"{x:.3f}" for x in r.get(s, (0, 0, 0))) for _, r in runs]
    a = [r[s][0] for n, r in runs if n[0] == "a" and s in r]
    b = [r[s][0] for n, r in runs if n[0] == "b" and s in r]
    c3 = [r[s][0] for n, r in runs if n[0] == "c" and s in r]
    ratio = f"{min(b) / min(a):.3f}" if a and b else "-"
    if a and c3: ratio += f"  C/A {min(c3) / min(a):.3f}"
    print(f"{s:18s} " + " ".join(f"{x:>20s}" for x in cells) + f"   {ratio}")
PY
