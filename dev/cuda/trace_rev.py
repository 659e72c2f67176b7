#!/usr/bin/env python3
"""dev/cuda/trace_rev.py: digest of bwd_rev90's per-role clock trace (the `trace chunk c:`
lines that `check_bwd one B T H HV` prints from a -DFQ_REV_TRACE build; cycles from the
producer's first KA issue, -1 where a slot was not recorded). Prints, per phase, the
median over chunks 2..7 (steady state) of the cycles between two slots, and the period
(W's end to W's end). Usage: check_bwd_t one 8 4096 16 32 | python3 dev/cuda/trace_rev.py"""
import re
import statistics
import sys

# (name, from slot, to slot) -- slots as in gdn_cuda_bwd_reverse_sm90.cu's FQ_TR calls
PHASES = [
    ("checker KA (vectors, K^, A pad)", 0, 1), ("checker QO", 2, 3), ("checker HVV", 4, 5),
    ("HVV issue -> landed", 28, 4), ("S publish D'", 6, 7), ("S dOg^T Q", 7, 8),
    ("S waits Z'", 8, 9), ("S -Z'^T K^", 9, 10), ("V P + store", 11, 12), ("V X^T", 13, 14),
    ("V scale + dO^T P + VEMPTY", 14, 15), ("V dVn store + Z", 15, 16), ("V Z' store", 16, 17),
    ("V dv, dbeta", 17, 18), ("W F1 + dot", 19, 20), ("W waits dVn", 20, 21),
    ("W dW, F2, d1, d2", 21, 22), ("W M1, M2, KK, Gl", 22, 23), ("W Gl K + dg wait", 23, 24),
    ("W dg", 24, 25),
]


def main():
    rows = {}
    for line in sys.stdin:
        m = re.match(r"trace chunk (\d+):(.*)", line.strip())
        if m:
            rows[int(m.group(1))] = [int(x) for x in m.group(2).split()]
    if not rows:
        print("no trace lines")
        return
    steady = [c for c in sorted(rows) if c >= 2] or sorted(rows)
    for name, a, b in PHASES:
        d = [rows[c][b] - rows[c][a] for c in steady if rows[c][a] >= 0 and rows[c][b] >= 0]
        if d:
            print(f"{name:34s} {statistics.median(d):8.0f}")
    per = [rows[c][25] - rows[c - 1][25] for c in steady if c - 1 in rows]
    if per:
        print(f"{'period (W end to W end)':34s} {statistics.median(per):8.0f}  cycles")


if __name__ == "__main__":
    main()
