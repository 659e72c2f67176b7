#!/usr/bin/env bash
# dev/gpu_check.sh: THE script run on the GPU machine (H200). It builds flashqla with its
# CUDA backend, runs the GPU tests, compute-sanitizer (memcheck, racecheck) on a tiny run,
# then the side-by-side benchmark (flashqla, FlashQLA 0.1.3, FLA 0.6.0), and prints the
# benchmark's final table LAST.
#
# The device call (the run tool), composed in the repository root here:
#   command: FQ_COMMIT=<git rev-parse --short HEAD> bash dev/gpu_check.sh [options]
#   carry:   [".peers", ".tcache"]     (each only if present; both are ignored paths)
#   e.g. forward rows only, no tests:  FQ_COMMIT=abc1234 FQ_BENCH_ARGS="--rows fwd" bash dev/gpu_check.sh --no-tests --no-sanitizer
#        everything:                   FQ_COMMIT=abc1234 bash dev/gpu_check.sh
# Before the first call, here: bash ../shared/tools/peer_wheels.sh (-> .peers/site.tar.xz, ~39 MB)
# and benchmarks/prebuild_flashqla_cache.py (-> .peers/flashqla_cache.tar.xz, ~2 MB, see its
# header). Carry limit 64 MiB in all: site 39 MB + FlashQLA cache ~2 MB + .tcache <= 15 MB fits.
#
#   bash dev/gpu_check.sh [--quick] [--no-bench] [--no-tests] [--no-sanitizer] [--all-tests]
#
#   --quick         fewer timing replays, racecheck on the quick case set
#   --all-tests     the whole test suite instead of the tests marked gpu
# Environment: OUT (default /tmp/out) receives build.log, pytest_gpu.log, sanitizer.log,
# bench.log, the results JSON + PNG, triton_cache.txz and flashqla_cache.tar.xz (8 files, the
# device tool returns 8 at most; with FQ_PRE_CMD's pre.log the PNG is left out: plot.py
# redraws it from the JSON). FQ_TOTAL_BUDGET (s, default 540) bounds the whole run: each stage
# gets what is left minus a reserve for the later ones, the benchmark skips rows it has no
# time for and gives FLA's process what is left. FQ_BENCH_ARGS adds arguments to bench_gpu.py
# (e.g. "--rows fwd", "--rows fwd,train", "--no-fla"). FQ_PYTEST_K: a pytest -k expression that
# narrows the GPU tests (e.g. "recurrent or serving" after a change to the recurrent step only;
# a kernel change is done only after the whole GPU suite ran). FQ_PRE_CMD: a dev command run after the
# build, before the tests (output in $OUT/pre.log). FQ_COMMIT: the commit recorded in the
# results JSON (the device copy has no .git). FQ_PYTEST_WORKERS=N (default 0: one process):
# the GPU tests in N pytest-xdist processes on the one GPU (their float64 references are
# single-threaded CPU work; the suite passes under xdist on the CPU, not yet tried on the
# GPU machine), xdist installed from .devwheels/*.whl when the device's Python lacks it
# (carry .devwheels: `pip download --no-deps -d .devwheels pytest-xdist execnet` here).
#
# Carried inputs (ignored paths named in the device call's `carry`):
#   .peers/site.tar.xz   FLA 0.6.0, FlashQLA 0.1.3, TileLang 0.1.15 and their dependencies
#                        (../shared/tools/peer_wheels.sh); unpacked into /tmp/peers, which goes
#                        on PYTHONPATH: FlashQLA is timed in bench_gpu.py's process, FLA in a
#                        child process started with FLA_DISABLE_BACKEND_DISPATCH=1
#   .peers/flashqla_cache.tar.xz  FlashQLA's compiled kernels (TileLang cache entries), from
#                        benchmarks/prebuild_flashqla_cache.py or from an earlier run's $OUT;
#                        unpacked into TILELANG_CACHE_DIR (default /tmp/tilelang_cache). When the
#                        run compiles new kernels, the whole cache comes back as
#                        $OUT/flashqla_cache.tar.xz: copy it to .peers/ for the next call
#   .whl/    (older way, used only without .peers/site.tar.xz) FLA's wheel, into /tmp/site
#   .tcache/ triton_cache.txz (or .tgz) from an earlier run's $OUT: FLA's compiled kernels
#            and/or autotune picks, which saves minutes of FLA compilation and autotuning
# Each stage's failure is reported and the next stage still runs, except after a failed build.
set -uo pipefail
export PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1

QUICK=0; BENCH=1; TESTS=1; SAN=1; ALLTESTS=0
for a in "$@"; do
    case "$a" in
        --quick) QUICK=1 ;;
        --no-bench) BENCH=0 ;;
        --no-tests) TESTS=0 ;;
        --no-sanitizer) SAN=0 ;;
        --all-tests) ALLTESTS=1 ;;
        -h|--help) sed -n '2,48p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown option $a"; exit 2 ;;
    esac
done

TOTAL=${FQ_TOTAL_BUDGET:-540}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(el) )); }
SUMMARY=""
stage_begin() { SNAME=$1; ST=$(date +%s); echo; echo "=== [$(el) s] $SNAME ==="; }
stage_end() {
    local d=$(( $(date +%s) - ST ))
    SUMMARY+=$(printf '%-16s %4d s  %s' "$SNAME" "$d" "$1")$'\n'
    echo "=== [$(el) s] $SNAME: $1 (${d} s) ==="
}
# cap CAP RESERVE: seconds a stage may take, given what later stages need.
cap() { local c=$1 r=$(( $(left) - $2 )); [ "$r" -lt "$c" ] && c=$r; echo "$c"; }
WARM_PID=""
stop_warmup() {
    if [ -n "$WARM_PID" ] && kill -0 "$WARM_PID" 2>/dev/null; then
        echo "stopping the FLA warm-up (pid $WARM_PID)"; kill "$WARM_PID" 2>/dev/null; wait "$WARM_PID" 2>/dev/null
    fi
    WARM_PID=""
}
# The Triton cache (FLA's compiled kernels + autotune picks) goes back in $OUT, under 15 MB:
# the whole cache if it compresses that far, else only the autotune picks (*.autotune.json:
# the next run then compiles only the winning configs and benchmarks none).
save_triton_cache() {
    local dir=${TRITON_CACHE_DIR:-/nonexistent} z=gzip ext=tgz sz what="whole cache"
    [ -d "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ] || return 0
    command -v xz > /dev/null 2>&1 && { z="xz -T0 -6"; ext=txz; }
    rm -f /tmp/triton_cache.t?z
    (cd "$dir" && tar cf - . | $z > "/tmp/triton_cache.$ext") 2>/dev/null
    sz=$(stat -c %s "/tmp/triton_cache.$ext" 2>/dev/null || echo 0)
    if [ "$sz" -ge 15000000 ]; then
        what="autotune picks only (whole cache: $sz bytes)"
        (cd "$dir" && find . -name '*.autotune.json' -print0 | tar cf - --null -T - | $z > "/tmp/triton_cache.$ext") 2>/dev/null
        sz=$(stat -c %s "/tmp/triton_cache.$ext" 2>/dev/null || echo 0)
    fi
    if [ "$sz" -gt 0 ] && [ "$sz" -lt 15000000 ]; then
        cp "/tmp/triton_cache.$ext" "$OUT/" && \
            echo "Triton cache saved: \$OUT/triton_cache.$ext, $what, $sz bytes (carry it next time as .tcache/triton_cache.$ext)"
    else
        echo "Triton cache not saved ($sz bytes)"
    fi
}
# untar_xz FILE DIR: tar's xz, or Python's lzma where the image has no xz.
untar_xz() {
    if command -v xz > /dev/null 2>&1; then tar -xJf "$1" -C "$2"; else
        python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" "$2"; fi
}
# FlashQLA's TileLang cache goes back in $OUT when this run compiled kernels into it.
save_flashqla_cache() {
    local dir=${TILELANG_CACHE_DIR:-/nonexistent} n sz
    [ -d "$dir" ] || return 0
    n=$(find "$dir" -mindepth 4 -maxdepth 4 -path '*/kernels/*' -type d 2>/dev/null | wc -l)
    if [ "$n" -le "${FQLA_CACHE_N0:-0}" ]; then
        echo "FlashQLA cache: $n kernels, none compiled in this run (nothing returned)"; return 0
    fi
    rm -f /tmp/flashqla_cache.tar.xz
    if command -v xz > /dev/null 2>&1; then
        (cd "$dir" && find . -mindepth 4 -maxdepth 4 -path '*/kernels/*' -type d -print0 | \
            tar cf - --null -T - | xz -T0 -6 > /tmp/flashqla_cache.tar.xz) 2>/dev/null
    else
        (cd "$dir" && python3 -c "
import glob, tarfile
with tarfile.open('/tmp/flashqla_cache.tar.xz', 'w:xz', preset=6) as tar:
    for d in sorted(glob.glob('*/*/kernels/*')):
        tar.add(d)") 2>/dev/null
    fi
    sz=$(stat -c %s /tmp/flashqla_cache.tar.xz 2>/dev/null || echo 0)
    if [ "$sz" -gt 0 ] && [ "$sz" -lt 16000000 ]; then
        cp /tmp/flashqla_cache.tar.xz "$OUT/" && echo "FlashQLA cache saved: \$OUT/flashqla_cache.tar.xz," \
            "$n kernels ($(( n - ${FQLA_CACHE_N0:-0} )) new), $sz bytes (carry it next time as .peers/flashqla_cache.tar.xz)"
    else
        echo "FlashQLA cache not saved ($sz bytes, $n kernels)"
    fi
}
# The device tool returns 8 files at most: leave out what can be remade here.
trim_out() {
    local n
    n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
    if [ "$n" -gt 8 ]; then
        for f in "$OUT"/*.png; do [ -f "$f" ] && rm -f "$f" && echo "left out $(basename "$f") (8 files at most; redraw: python3 benchmarks/plot.py JSON)"; done
    fi
    n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
    if [ "$n" -gt 8 ] && [ -f "$OUT/pre.log" ]; then
        { echo; echo "=== pre.log ==="; cat "$OUT/pre.log"; } >> "$OUT/build.log" && rm -f "$OUT/pre.log" && echo "pre.log appended to build.log"
    fi
}
final_print() {
    stop_warmup
    if [ -f /tmp/fla_warmup.log ] && [ -f "$OUT/bench.log" ]; then
        { echo; echo "=== FLA warm-up log ==="; cat /tmp/fla_warmup.log; } >> "$OUT/bench.log"
    elif [ -f /tmp/fla_warmup.log ]; then
        cp /tmp/fla_warmup.log "$OUT/bench.log"
    fi
    save_triton_cache
    save_flashqla_cache
    trim_out
    echo; echo "=== stages (total $(el) s of budget $TOTAL s) ==="; printf '%s' "$SUMMARY"
    if [ -s /tmp/fq_ratio_table.txt ]; then cat /tmp/fq_ratio_table.txt; fi
}

# ------------------------------------------------------------------ environment --
stage_begin "environment"
nvidia-smi -L 2>&1 || echo "nvidia-smi failed"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 || true
python3 - <<'EOF' 2>&1 || echo "python/torch check failed"
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "L2 MB", getattr(p, "L2_cache_size", 0) / 2**20,
          "capability", "%d.%d" % (p.major, p.minor))
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton not importable:", e)
EOF
nvcc --version 2>&1 | tail -n 2 || echo "nvcc not found"
rm -f /tmp/fq_ratio_table.txt /tmp/fq_results_path.txt /tmp/fla_warmup.log
# FLA, FlashQLA and TileLang travel as one tarball (../shared/tools/peer_wheels.sh), unpacked
# into /tmp/peers (put on PYTHONPATH); without it, FLA's wheel alone from .whl/ as before.
if [ -f .peers/site.tar.xz ]; then
    rm -rf /tmp/peers && mkdir -p /tmp/peers
    if untar_xz .peers/site.tar.xz /tmp/peers; then
        export PYTHONPATH=/tmp/peers${PYTHONPATH:+:$PYTHONPATH}
        echo "unpacked .peers/site.tar.xz into /tmp/peers ($(du -sm /tmp/peers | cut -f1) MB)"
    else
        echo "unpacking .peers/site.tar.xz failed: FlashQLA and FLA columns will be empty"
    fi
elif compgen -G ".whl/*.whl" > /dev/null; then
    # only non-framework wheels go into /tmp/site (never shadow torch/triton)
    WHEELS=()
    for w in .whl/*.whl; do
        case "$(basename "$w")" in
            torch-*|triton-*|numpy-*|nvidia_*|jax-*|jaxlib-*|setuptools-*|pip-*|wheel-*) echo "not installing $w (the device has its own)" ;;
            *) WHEELS+=("$w") ;;
        esac
    done
    if [ ${#WHEELS[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site "${WHEELS[@]}"; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        echo "installed into /tmp/site: ${WHEELS[*]}"
    else
        echo "wheel install failed: FLA columns will be empty"
    fi
else
    echo "no .peers/site.tar.xz (nor .whl/) carried: FlashQLA and FLA columns will be empty"
fi
(cd /tmp && FLA_DISABLE_BACKEND_DISPATCH=1 python3 -c "import fla; print('fla', fla.__version__, fla.__file__)") 2>&1 | grep -v Warning | tail -n 2
python3 -c "import importlib.metadata as m; print('flash-qla', m.version('flash-qla'), '| tilelang', m.version('tilelang'))" 2>&1 | tail -n 1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang_cache}
mkdir -p "$TILELANG_CACHE_DIR"
if [ -f .peers/flashqla_cache.tar.xz ]; then
    untar_xz .peers/flashqla_cache.tar.xz "$TILELANG_CACHE_DIR" && echo "restored FlashQLA's kernel cache from .peers/flashqla_cache.tar.xz"
fi
FQLA_CACHE_N0=$(find "$TILELANG_CACHE_DIR" -mindepth 4 -maxdepth 4 -path '*/kernels/*' -type d 2>/dev/null | wc -l)
echo "TILELANG_CACHE_DIR=$TILELANG_CACHE_DIR holds $FQLA_CACHE_N0 compiled FlashQLA kernels"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
for f in .tcache/triton_cache.txz .tcache/triton_cache.tgz; do
    [ -f "$f" ] || continue
    case "$f" in *.txz) dec="xz -dc" ;; *) dec="gzip -dc" ;; esac
    $dec "$f" | tar xf - -C "$TRITON_CACHE_DIR" && echo "restored the Triton cache from $f ($(find "$TRITON_CACHE_DIR" -type f | wc -l) files)"
    break
done
command -v compute-sanitizer > /dev/null 2>&1 && echo "compute-sanitizer: $(command -v compute-sanitizer)"
stage_end "ok"

# FLA's Triton compile + autotune runs on the GPU while the build uses the CPUs (stopped
# before the tests start, so that nothing else runs on the GPU while it autotunes), for the
# passes the benchmark will run (FQ_BENCH_ARGS's --rows); FLA_DISABLE_BACKEND_DISPATCH=1.
case " ${FQ_BENCH_ARGS:-} " in *" --no-fla "*) FLA_WARM=0 ;; *) FLA_WARM=1 ;; esac
if [ "$BENCH" = 1 ] && [ "$FLA_WARM" = 1 ] && FLA_DISABLE_BACKEND_DISPATCH=1 python3 -c "import fla" > /dev/null 2>&1; then
    WROWS=$(echo " ${FQ_BENCH_ARGS:-} " | sed -n 's/.* --rows[ =]\([^ ]*\) .*/\1/p')
    FLA_DISABLE_BACKEND_DISPATCH=1 python3 benchmarks/bench_gpu.py --fla-warmup-only --rows "${WROWS:-all}" \
        > /tmp/fla_warmup.log 2>&1 &
    WARM_PID=$!
    echo "FLA warm-up (rows ${WROWS:-all}) started in the background (pid $WARM_PID)"
fi

# ------------------------------------------------------------------------ build --
stage_begin "build"
BUILD_CAP=$(cap 330 150)
# nothing after it runs without a build: never cut it below 240 s, whatever FQ_TOTAL_BUDGET says
[ "$BUILD_CAP" -lt 240 ] && BUILD_CAP=240
( time timeout "$BUILD_CAP" python3 -m pip install --no-build-isolation --no-deps -v -e . ) > "$OUT/build.log" 2>&1
rc=$?
grep -E "^real" "$OUT/build.log" | tail -n 1
if [ $rc -ne 0 ]; then
    echo "--- build failed (rc $rc; 124 = over the ${BUILD_CAP} s cap); tail of build.log:"
    tail -n 60 "$OUT/build.log"
    stage_end "FAILED rc=$rc"
    final_print
    exit 1
fi
# compiler diagnostics from our own sources (setuptools' chatter left out)
grep -E "\.(c|h|cu|cuh)(\([0-9]+\)|:[0-9]+).*(warning|error)|ptxas (warning|error|fatal)" "$OUT/build.log" | sort -u | head -n 20
IMPORT_OK=1
(cd /tmp && python3 -c "import flashqla, flashqla._C as C; print('flashqla', getattr(flashqla, '__version__', '?'), 'from', flashqla.__file__, '| cuda_built', C.cuda_built())") 2>&1 | tail -n 3
python3 -c "import flashqla._C as C; assert C.cuda_built(), 'CUDA backend not built'" 2>&1 | tail -n 2 || IMPORT_OK=0
if [ $IMPORT_OK = 1 ]; then stage_end "ok"; else stage_end "built, but flashqla._C is missing or has no CUDA backend"; fi

if [ -n "$WARM_PID" ]; then
    WAIT_CAP=$(cap 150 240)
    echo "waiting up to ${WAIT_CAP} s for the FLA warm-up to finish"
    for _ in $(seq 1 "$WAIT_CAP"); do kill -0 "$WARM_PID" 2>/dev/null || break; sleep 1; done
    stop_warmup
    tail -n 3 /tmp/fla_warmup.log
fi

# ------------------------------------------------------------- dev pre-command --
# FQ_PRE_CMD (optional): a command run here, after the build and the FLA warm-up and
# before the tests, with the GPU otherwise idle (e.g. dev/cuda/run_check_fwd.sh ab);
# its output goes to $OUT/pre.log and is printed.
if [ -n "${FQ_PRE_CMD:-}" ]; then
    stage_begin "pre-command"
    PC=$(cap 300 $(( TESTS * 130 + SAN * 25 + BENCH * 200 )))  # reserves only for the stages that run
    [ "$PC" -lt 1 ] && PC=1
    timeout "$PC" bash -c "$FQ_PRE_CMD" > "$OUT/pre.log" 2>&1
    rc=$?
    cat "$OUT/pre.log" | tail -n 80
    stage_end "rc=$rc"
fi

# ------------------------------------------------------------------------ tests --
if [ "$TESTS" = 1 ]; then
    stage_begin "tests"
    # (the whole GPU suite took 172-190 s on the H100 in session 23 and was cut once at 200:
    # up to 280 s when the budget allows)
    TEST_CAP=$(cap 280 $(( SAN * 25 + BENCH * 205 )))
    if [ "$TEST_CAP" -lt 30 ]; then
        stage_end "skipped (no time left)"
    else
        SEL=(-m gpu); [ "$ALLTESTS" = 1 ] && SEL=()
        [ -n "${FQ_PYTEST_K:-}" ] && SEL+=(-k "$FQ_PYTEST_K")
        TO=(); python3 -c "import pytest_timeout" > /dev/null 2>&1 && TO=(--timeout=120)
        if [ "${FQ_PYTEST_WORKERS:-0}" -gt 0 ]; then
            python3 -c "import xdist" > /dev/null 2>&1 || { ls .devwheels/*.whl > /dev/null 2>&1 &&
                python3 -m pip install -q --no-index --no-deps .devwheels/*.whl > /dev/null 2>&1; }
            if python3 -c "import xdist" > /dev/null 2>&1; then
                TO+=(-n "$FQ_PYTEST_WORKERS"); echo "pytest-xdist: $FQ_PYTEST_WORKERS workers"
            else
                echo "pytest-xdist: not available (no .devwheels carried?): one process"
            fi
        fi
        # torch.compile's tests in-process: at 4f71228 pytest had finished every test and then
        # waited at exit for inductor's compile-worker pool until the cap's SIGINT (rc 124)
        export TORCHINDUCTOR_COMPILE_THREADS=1
        # at the cap pytest gets SIGINT first, so that it still prints its failures and counts
        # (killed 15 s later if it has not stopped)
        timeout -s INT -k 15 "$(( TEST_CAP - 15 ))" python3 -m pytest tests "${SEL[@]}" -q -rfE \
            --maxfail="${FQ_MAXFAIL:-10}" --durations=20 "${TO[@]}" -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
        rc=$?
        grep -E "^(FAILED|ERROR) " "$OUT/pytest_gpu.log" | head -n 20
        line=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran" "$OUT/pytest_gpu.log" | tail -n 1)
        echo "pytest: ${line:-no summary line (see pytest_gpu.log)}"
        [ $rc -eq 124 ] && echo "pytest stopped at the ${TEST_CAP} s cap"
        stage_end "rc=$rc ${line:-}"
    fi
fi

# -------------------------------------------------------------------- sanitizer --
if [ "$SAN" = 1 ]; then
    stage_begin "sanitizer"
    CS=$(command -v compute-sanitizer || true)
    [ -z "$CS" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && CS=/usr/local/cuda/bin/compute-sanitizer
    if [ -z "$CS" ]; then
        echo "compute-sanitizer not found" > "$OUT/sanitizer.log"; stage_end "skipped (no compute-sanitizer)"
    else
        : > "$OUT/sanitizer.log"
        RES=""
        for tool in memcheck racecheck; do
            if [ "$tool" = memcheck ]; then C=$(cap 120 190); ARGS=(); else C=$(cap 90 160); ARGS=(--quick); fi
            [ "$QUICK" = 1 ] && ARGS=(--quick)
            if [ "$C" -lt 20 ]; then RES+="$tool: skipped (time); "; continue; fi
            echo "--- $tool (cap ${C} s)" | tee -a "$OUT/sanitizer.log"
            timeout "$C" "$CS" --tool "$tool" --error-exitcode 86 --print-limit 30 \
                python3 dev/sanitize_small.py "${ARGS[@]}" >> "$OUT/sanitizer.log" 2>&1
            rc=$?
            sed -n '/^--- '"$tool"'/,$p' "$OUT/sanitizer.log" | \
                grep -E "sanitize_small: .*(FAIL|raised|ALL OK|FAILED|nothing to check)|ERROR SUMMARY|RACECHECK SUMMARY|Device not supported|Traceback" | tail -n 8
            case $rc in
                0) RES+="$tool: clean; " ;;
                86) RES+="$tool: ERRORS (rc 86); " ;;
                2) RES+="$tool: no CUDA device seen; " ;;
                124) RES+="$tool: timed out at ${C} s; " ;;
                *) RES+="$tool: rc $rc (checks failed or crashed); " ;;
            esac
        done
        stage_end "$RES"
    fi
fi

# ------------------------------------------------------------------------ bench --
if [ "$BENCH" = 1 ]; then
    stage_begin "bench"
    BC=$(( $(left) - 15 ))
    if [ "$BC" -lt 60 ]; then
        stage_end "skipped (no time left: $(left) s)"
    else
        QA=(); [ "$QUICK" = 1 ] && QA=(--quick)
        # rows start until BC - 45 s; FLA's process gets what is left of that minus 15 s
        # shellcheck disable=SC2086
        timeout "$BC" python3 benchmarks/bench_gpu.py --rows all "${QA[@]}" --out benchmarks/results \
            --time-budget $(( BC - 45 )) --table-file /tmp/fq_ratio_table.txt --path-file /tmp/fq_results_path.txt \
            ${FQ_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
        rc=$?
        if [ ! -s /tmp/fq_ratio_table.txt ] && [ -s /tmp/fq_results_path.txt ]; then
            J=$(head -n 1 /tmp/fq_results_path.txt)
            if [ -f "$J" ]; then
                echo "bench stopped early (rc $rc): tables from the partial $J"
                python3 benchmarks/bench_gpu.py --from-json "$J" --table-file /tmp/fq_ratio_table.txt > /dev/null 2>&1
            fi
        fi
        stage_end "rc=$rc"
    fi
fi

final_print
exit 0
