# dev/cuda/devrun_lib.sh: what the device-side dev scripts share (sourced, not run):
#   fq_unpack_bins SRC DST         every SRC/*.xz (carried compressed binaries) into DST, executable
#   fq_sanitize_pair LOG TIMEOUT BIN MEMARGS RACEARGS
#                                  compute-sanitizer memcheck (BIN MEMARGS) and racecheck (BIN
#                                  RACEARGS) in parallel, logs LOG_memcheck.log / LOG_racecheck.log,
#                                  then one verdict line each (MEMARGS / RACEARGS are word lists)
fq_unpack_bins() {
    mkdir -p "$2"
    local f
    for f in "$1"/*.xz; do
        [ -e "$f" ] || continue
        xz -dc "$f" > "$2/$(basename "$f" .xz)" && chmod +x "$2/$(basename "$f" .xz)"
    done
}

fq_sanitize_pair() {
    local log=$1 to=$2 bin=$3 mem=$4 race=$5
    if ! command -v compute-sanitizer > /dev/null; then echo "(no compute-sanitizer)"; return 0; fi
    # shellcheck disable=SC2086 # (the argument lists are meant to split)
    ( timeout "$to" compute-sanitizer --tool memcheck --print-limit 20 "$bin" $mem > "${log}_memcheck.log" 2>&1 ) &
    local j1=$!
    # shellcheck disable=SC2086
    ( timeout "$to" compute-sanitizer --tool racecheck --print-limit 20 "$bin" $race > "${log}_racecheck.log" 2>&1 ) &
    local j2=$!
    wait $j1 $j2
    echo "memcheck:  $(grep -E 'FAIL|passed|ALL OK|correctness:|ERROR SUMMARY' "${log}_memcheck.log" | tail -3 | tr '\n' ' ')"
    echo "racecheck: $(grep -E 'FAIL|passed|ALL OK|correctness:|RACECHECK SUMMARY|ERROR SUMMARY' "${log}_racecheck.log" | tail -3 | tr '\n' ' ')"
}
