#!/usr/bin/env python3
"""dev/cuda/check_omap_layout.py: a model of the fused forward's segment maps in o (fq_omap,
csrc/cuda/gdn_cuda_common.cuh) and of the split rule that lets them fit
(fq_fwd_segments_kernel, csrc/cuda/gdn_cuda_fwd_fused.cu), checked over head dims, dtypes and
sequence lengths without a GPU. The formulas below are the C ones, transcribed; for every split
it asserts, per (sequence, head):
  - every start-state element of segment s lies in the segment's own rows and in o's columns
    of its 64-column block vb (only the FULL CTA (s, j, vb) writes there, after reading it);
  - every map element lies in the sequence's rows, outside every start state, and no two
    elements (of the maps and start states together) share a byte;
  - the map and start-state elements of one thread's fq_omap_at / fq_omap_ss calls stay in
    one row (float4 pieces of the combine).
Run: python3 dev/cuda/check_omap_layout.py   (about a minute)"""
import itertools
import sys

SMS = 132


def nseg_max(HV, K, V):
    full, mp = HV * (V // 64), HV * ((K + V) // 64)
    n = min(SMS // full, 1 + 2 * SMS // mp, 16)
    return 1 if n < 3 else n


def omap(K, V, elem):
    rb = V * elem
    lf = {128: 7, 64: 6, 32: 5}[rb // 4]
    return dict(rb=rb, lf=lf, lfs=6 if elem == 4 else 5, sb=64 * elem, rss=4 * K // elem,
                rblk=(64 * K) >> lf, ncb=(K + V) // 64)


def split(length, HV, K, V, m, min_chunks=8):
    nc = (length + 63) // 64
    n = min(nc // min_chunks, nseg_max(HV, K, V))
    while n >= 3:
        L = -(-nc // n)
        P = -(-nc // L)
        last = length - (P - 1) * 64 * L
        cap, capl = (64 * L - m["rss"]) // m["rblk"], (last - m["rss"]) // m["rblk"]
        if last >= m["rss"] and cap >= 1 and (P - 1) * cap + capl >= (P - 1) * m["ncb"]:
            break
        n -= 1
    if n < 3:
        return 1, nc
    L = -(-nc // n)
    return -(-nc // L), L


def ss_addr(m, bos, kd, c):  # byte offset in the head's row space: (row, byte in row); vb separately
    e = 64 * kd + c
    return bos + (e >> m["lfs"]), 4 * (e & ((1 << m["lfs"]) - 1))


def blk_row(m, bos0, L, P, B):
    cap = (64 * L - m["rss"]) // m["rblk"]
    s = min(B // cap, P - 1)
    return bos0 + s * 64 * L + m["rss"] + (B - s * cap) * m["rblk"]


def at_addr(m, R, kd, c):
    e = 64 * kd + c
    return R + (e >> m["lf"]), 4 * (e & ((1 << m["lf"]) - 1))


def check(length, HV, K, V, elem):
    m = omap(K, V, elem)
    P, L = split(length, HV, K, V, m)
    if P == 1:
        return 1
    seg_rows = [(64 * L * s, min(64 * L * (s + 1), length)) for s in range(P)]
    used = {}
    # start states: segment s, block vb, element (kd, c)
    for s in range(P):
        b0, b1 = seg_rows[s]
        for vb in range(V // 64):
            for kd in range(K):
                for c in range(0, 64, 4):
                    r, byte = ss_addr(m, b0, kd, c)
                    assert b0 <= r < b1, ("ss row outside its segment", length, K, V, elem, s, kd, c)
                    assert byte + 16 <= m["sb"], ("ss piece crosses its column block", K, V, elem)
                    key = (r, vb * m["sb"] + byte)
                    assert key not in used, ("overlap", key, used[key], ("ss", s, vb, kd, c))
                    used[key] = ("ss", s, vb, kd, c)
    # maps: segments 0 .. P-2, blocks cb, element (kd, c)
    for sg in range(P - 1):
        for cb in range(m["ncb"]):
            R = blk_row(m, 0, L, P, m["ncb"] * sg + cb)
            for kd in range(K):
                for c in range(0, 64, 4):
                    r, byte = at_addr(m, R, kd, c)
                    assert 0 <= r < length, ("map row outside the sequence", length, K, V, elem, sg, cb)
                    assert byte + 16 <= m["rb"], ("map piece crosses its row", K, V, elem)
                    key = (r, byte)
                    assert key not in used, ("overlap", key, used[key], ("md", sg, cb, kd, c))
                    used[key] = ("md", sg, cb, kd, c)
    return P


def main():
    n = 0
    splits = {}
    lengths = sorted(set(list(range(1, 3000, 37)) + [2048, 4096, 8192, 16384, 32768, 32700, 65536] +
                         [64 * c + d for c in (24, 40, 64, 96, 200) for d in (-63, -1, 0, 1)]))
    for K, V, elem in itertools.product((64, 128), (64, 128), (2, 4)):
        for HV in (1, 2, 4, 8, 16):
            for length in lengths:
                if length > 9000 and HV > 2 and length != 32768:  # (the long ones on few heads only: time)
                    continue
                P = check(length, HV, K, V, elem)
                n += 1
                splits[(K, V, elem, HV, length)] = P
    print(f"{n} (K, V, elem, HV, length) cases: start states in their segments' own rows and "
          f"column blocks, maps in the sequence's rows, no byte shared")
    for key in [(128, 128, 2, 8, 4096), (128, 128, 2, 8, 32768), (128, 128, 2, 4, 32768), (128, 128, 2, 2, 2048),
                (128, 128, 4, 2, 2048), (64, 128, 2, 2, 2048), (64, 64, 2, 2, 2048), (128, 64, 2, 2, 2048)]:
        print("  K V elem HV len", key, "->", splits.get(key), "segments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
