"""Lane-level NumPy simulation of fq_bwd_state_kernel (csrc/cuda/gdn_cuda_bwd_state.cu,
the backward's reverse state pass) on the CPU: ldmatrix / mma.sync m16n8k16 fragments, the
shuffle-transposed stores, the cp.async ring (parts, zero-filled padding rows,
wait counts) and the K-split exchange, all from the kernel's own index
formulas; compared with the plain equations (same bf16 roundings) in float64.
Inputs are scaled so the reverse recurrence does not amplify rounding flips.
Run: python dev/cuda/sim_bwd_state.py (numpy; ~5 s)."""
import numpy as np, sys

def bf(x):  # round to bf16 (RNE), returned as float32
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)

def pack(x, y): return (float(bf(x)), float(bf(y)))

class Smem:  # flat bf16 buffer with element addressing
    def __init__(s, n): s.m = np.full(n, np.nan, np.float32)

def ldsm_x4(sm, addrs, trans):
    # addrs[l]: element address of row (l%8) of matrix l//8 (8 consecutive elems)
    r = [[None]*4 for _ in range(32)]
    for i in range(4):
        M = np.array([sm.m[addrs[8*i+rr]: addrs[8*i+rr]+8] for rr in range(8)])
        for L in range(32):
            if not trans: r[L][i] = (M[L//4, 2*(L%4)], M[L//4, 2*(L%4)+1])
            else: r[L][i] = (M[2*(L%4), L//4], M[2*(L%4)+1, L//4])
    return r

def frag_a(sm, base, ld, m0, k0):
    ad = []
    for l in range(32):
        row = m0 + (l & 7) + ((l >> 3) & 1) * 8; col = k0 + (l >> 4) * 8
        ad.append(base + row*ld + col)
    return ldsm_x4(sm, ad, False)
def frag_a_trans(sm, base, ld, m0, k0):
    ad = []
    for l in range(32):
        mi = l >> 3; row = k0 + (l & 7) + (mi >> 1) * 8; col = m0 + (mi & 1) * 8
        ad.append(base + row*ld + col)
    return ldsm_x4(sm, ad, True)
def frag_b_nk(sm, base, ld, n0, k0):
    ad = []
    for l in range(32):
        row = n0 + (l & 7) + (l >> 4) * 8; col = k0 + ((l >> 3) & 1) * 8
        ad.append(base + row*ld + col)
    return ldsm_x4(sm, ad, False)
def frag_b_kn(sm, base, ld, k0, n0):
    ad = []
    for l in range(32):
        row = k0 + (l & 7) + ((l >> 3) & 1) * 8; col = n0 + (l >> 4) * 8
        ad.append(base + row*ld + col)
    return ldsm_x4(sm, ad, True)

def mma(d, a, b0, b1):
    # d[L] = [4 floats], a[L] = 4 packed, b0[L], b1[L] packed
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for L in range(32):
        g, t = L // 4, L % 4
        A[g, 2*t:2*t+2] = a[L][0]; A[g+8, 2*t:2*t+2] = a[L][1]
        A[g, 2*t+8:2*t+10] = a[L][2]; A[g+8, 2*t+8:2*t+10] = a[L][3]
        B[2*t:2*t+2, g] = b0[L]; B[2*t+8:2*t+10, g] = b1[L]
    C = A @ B
    for L in range(32):
        g, t = L // 4, L % 4
        d[L][0] += C[g, 2*t]; d[L][1] += C[g, 2*t+1]; d[L][2] += C[g+8, 2*t]; d[L][3] += C[g+8, 2*t+1]

def st_transposed(glob, dst, w, store):
    # dst[L]: flat element index; w[L]: packed
    for L in range(32):
        g = L >> 2; p = w[L ^ 4]
        x = (p[1], w[L][1]) if (g & 1) else (w[L][0], p[0])
        if store[L] if isinstance(store, list) else store:
            glob[dst[L]] = x[0]; glob[dst[L]+1] = x[1]

def run(K, V, NW, KS, NS, nch, lens_last, H, HV, j, seed):
    rng = np.random.default_rng(seed)
    BV = 16*NW; LDK = K+8; LDB = BV+8; NTH = NW*KS*32; KW = K//KS; NKT = KW//8
    # globals: one sequence n=0 starting at bos, chunks chunk0.., heads HV
    bos, chunk0 = 3*64, 2
    T = bos + 64*(nch-1) + lens_last + 70
    slen = 64*(nch-1) + lens_last
    nct = chunk0 + nch + 1
    kb = bf(rng.standard_normal((T, H, K)).astype(np.float32)*0.08).ravel()
    w = bf(rng.standard_normal((nct, HV, 64, K)).astype(np.float32)*0.08)
    gamma = -np.abs(rng.standard_normal((nct, HV, 64))).astype(np.float32).cumsum(-1)*0.05
    kdecay = np.exp(gamma[..., 63:64] - gamma).astype(np.float32)
    for c in range(chunk0, chunk0+nch):   # padding rows of the last chunk
        ln = lens_last if c == chunk0+nch-1 else 64
        w[c, :, ln:] = 0; kdecay[c, :, ln:] = 0; gamma[c, :, ln:] = gamma[c, :, ln-1:ln]
    w = w.ravel(); gamma = gamma.ravel(); kdecay = kdecay.ravel()
    dvl = bf(rng.standard_normal((nct, HV, 64, V)).astype(np.float32)).ravel()
    dsl = bf(rng.standard_normal((nct, HV, K, V)).astype(np.float32)).ravel()
    dht = rng.standard_normal((1, HV, K, V)).astype(np.float32).ravel()
    dvl0, dsl0 = dvl.copy(), dsl.copy()
    hq = j // (HV // H)
    # ---- reference (plain equations, same roundings) ----
    out_dvl = dvl0.copy(); out_dsl = dsl0.copy()
    dS = dht.reshape(1, HV, K, V)[0, j].astype(np.float64)
    for i in range(nch-1, -1, -1):
        c = chunk0 + i; ln = 64 if i < nch-1 else lens_last
        Kc = np.zeros((64, K)); Kc[:ln] = kb.reshape(T, H, K)[bos+64*i: bos+64*i+ln, hq]
        W = w.reshape(nct, HV, 64, K)[c, j].astype(np.float64)
        kd = kdecay.reshape(nct, HV, 64)[c, j].astype(np.float64)
        egC = float(np.exp(gamma.reshape(nct, HV, 64)[c, j, 63]))
        dsn = bf(dS).astype(np.float64)
        out_dsl.reshape(nct, HV, K, V)[c, j] = dsn
        dvn = bf(dvl0.reshape(nct, HV, 64, V)[c, j] + kd[:, None] * (Kc @ dsn)).astype(np.float64)
        out_dvl.reshape(nct, HV, 64, V)[c, j] = dvn
        dS = egC*dS + dsl0.reshape(nct, HV, K, V)[c, j] - W.T @ dvn
    ref_dh0 = dS
    # ---- kernel simulation, every block of head j (n = 0) ----
    nvs = V // BV
    dh0 = np.full(HV*K*V, np.nan)
    for vs in range(nvs):
        buf_sz = 64*LDK*2 + 64*LDB + K*LDB + 128
        b_w, b_k = 0, 64*LDK; b_dv = b_k + 64*LDK; b_ds = b_dv + 64*LDB; b_g = b_ds + K*LDB; b_d = b_g + 64
        sm = Smem(NS*buf_sz)
        xch = {}
        state_off = j*K*V
        NPART = KW//16; RP = 64//NPART; SP = K//NPART; CPR = K//8; RSTEP = NTH//CPR; UPR = BV//8; USTEP = NTH//UPR
        assert NTH % CPR == 0 and NTH % UPR == 0 and RP % RSTEP == 0 and 64 % USTEP == 0 and SP % USTEP == 0
        warps = [(wp // KS, wp % KS) for wp in range(NW*KS)]
        D = {}
        for wp, (grp, kh) in enumerate(warps):
            vw = vs*BV + 16*grp; k0 = kh*KW
            D[wp] = [[[dht[state_off + (k0+8*nt+2*(L%4)+(e&1))*V + vw + L//4 + 8*(e>>1)] for e in range(4)] for nt in range(NKT)] for L in range(32)]
        pending = []  # cp.async groups: list of lists of (dst, src_array, src_idx, nbytes)
        cur = []
        def ld_base(i, tid):
            tile = (chunk0+i)*HV + j; row0 = bos + 64*i; ln = min(64, slen - 64*i)
            r_t, c_t, r_u, c_u = tid//CPR, (tid % CPR)*8, tid//UPR, (tid % UPR)*8
            return dict(w=(tile*64+r_t)*K+c_t, k=((row0+r_t)*H+hq)*K+c_t, dv=(tile*64+r_u)*V+vs*BV+c_u,
                        ds=(tile*K+r_u)*V+vs*BV+c_u, g=(('g', tile*64+tid*4) if tid < 16 else ('d', tile*64+(tid-16)*4)),
                        lim=ln-r_t, r_t=r_t, c_t=c_t, r_u=r_u, c_u=c_u)
        def load_part(lb, b, part, tid):
            base = b*buf_sz
            for it in range(RP//RSTEP):
                r = part*RP + it*RSTEP
                cur.append((base+b_w+(lb['r_t']+r)*LDK+lb['c_t'], 'w', lb['w']+r*K, 16))
                ok = r < lb['lim']
                cur.append((base+b_k+(lb['r_t']+r)*LDK+lb['c_t'], 'k', lb['k']+r*H*K if ok else 0, 16 if ok else 0))
            for it in range(SP//USTEP):
                r = part*SP + it*USTEP
                cur.append((base+b_ds+(lb['r_u']+r)*LDB+lb['c_u'], 'ds', lb['ds']+r*V, 16))
            if part == 0:
                for it in range(64//USTEP):
                    r = it*USTEP
                    cur.append((base+b_dv+(lb['r_u']+r)*LDB+lb['c_u'], 'dv', lb['dv']+r*V, 16))
                if tid < 32:
                    kind, off = lb['g']
                    dst = base + (b_g + tid*4 if tid < 16 else b_d + (tid-16)*4)
                    cur.append((dst, kind, off, 16))
        arrs = dict(w=w, k=kb, ds=dsl, dv=dvl, g=gamma, d=kdecay)
        def commit():
            pending.append(list(cur)); cur.clear()
        def wait(n):
            while len(pending) > n:
                grp_ = pending.pop(0)
                for dst, kind, src, nb in grp_:
                    ne = nb // 4 if kind in ('g', 'd') else nb // 2
                    vals = arrs[kind][src:src+8 if kind not in ('g', 'd') else src+4] if nb else np.zeros(8 if kind not in ('g','d') else 4)
                    assert len(vals) == (4 if kind in ('g','d') else 8)
                    if nb == 0: vals = np.zeros_like(vals)
                    sm.m[dst:dst+len(vals)] = vals
        for s in range(NS-1):
            if s < nch:
                for tid in range(NTH):
                    lb = ld_base(nch-1-s, tid)
                    for part in range(NPART): load_part(lb, s, part, tid)
            commit()
        V8 = 8*V
        for st in range(nch):
            i = nch-1-st
            wait(NS-2)
            snext = st+NS-1; bnext = snext % NS; more = snext < nch
            bb = (st % NS)*buf_sz
            tile = (chunk0+i)*HV + j
            accs = {}
            for wp, (grp, kh) in enumerate(warps):
                vw = vs*BV + 16*grp; k0 = kh*KW
                acc = [[[0.0]*4 for _ in range(8)] for L in range(32)]
                sl = [tile*K*V + k0*V + vw + (2*(L%4) + ((L>>2)&1))*V + ((L>>2) & ~1) for L in range(32)]
                for kk in range(KW//16):
                    af = [[pack(*D[wp][L][2*kk][0:2]), pack(*D[wp][L][2*kk][2:4]), pack(*D[wp][L][2*kk+1][0:2]), pack(*D[wp][L][2*kk+1][2:4])] for L in range(32)]
                    for n2 in range(4):
                        b = frag_b_nk(sm, bb+b_k, LDK, 16*n2, k0+16*kk)
                        mma([acc[L][2*n2] for L in range(32)], af, [b[L][0] for L in range(32)], [b[L][1] for L in range(32)])
                        mma([acc[L][2*n2+1] for L in range(32)], af, [b[L][2] for L in range(32)], [b[L][3] for L in range(32)])
                    for q in range(4):
                        st_transposed(dsl, [sl[L] + (2*kk+(q>>1))*V8 + 8*(q&1) for L in range(32)], [af[L][q] for L in range(32)], True)
                accs[wp] = acc
            # loads for the next chunk (issued by all threads; order irrelevant here)
            if more:
                for tid in range(NTH):
                    lb = ld_base(nch-1-snext, tid)
                    for part in range(NPART): load_part(lb, bnext, part, tid)
            commit()
            egC = float(np.exp(sm.m[bb+b_g+63]))
            for wp, (grp, kh) in enumerate(warps):
                k0 = kh*KW
                for kk in range(KW//16):
                    lf = frag_a_trans(sm, bb+b_ds, LDB, 16*grp, k0+16*kk)
                    for L in range(32):
                        for q in range(4):
                            x = D[wp][L][2*kk+(q>>1)]
                            e0 = 2*(q&1)
                            x[e0] = x[e0]*egC + float(lf[L][q][0]); x[e0+1] = x[e0+1]*egC + float(lf[L][q][1])
            if KS == 2:
                new = {}
                for wp in accs:
                    pa = accs[wp ^ 1]
                    new[wp] = [[[accs[wp][L][nt][e] + pa[L][nt][e] for e in range(4)] for nt in range(8)] for L in range(32)]
                accs = new
            for wp, (grp, kh) in enumerate(warps):
                vw = vs*BV + 16*grp; k0 = kh*KW
                acc = accs[wp]
                vl = [tile*64*V + vw + (2*(L%4) + ((L>>2)&1))*V + ((L>>2) & ~1) for L in range(32)]
                va = [[None]*4 for _ in range(4)]
                for kk in range(4):
                    uf = frag_a_trans(sm, bb+b_dv, LDB, 16*grp, 16*kk)
                    wv = [[None]*4 for L in range(32)]
                    for L in range(32):
                        t = L % 4
                        d0 = sm.m[bb+b_d+16*kk+2*t: bb+b_d+16*kk+2*t+2]; d8 = sm.m[bb+b_d+16*kk+8+2*t: bb+b_d+16*kk+10+2*t]
                        for q in range(4):
                            x = acc[L][2*kk+(q>>1)][2*(q&1): 2*(q&1)+2]
                            d = d8 if (q >> 1) else d0
                            wv[L][q] = pack(uf[L][q][0] + d[0]*x[0], uf[L][q][1] + d[1]*x[1])
                    for q in range(4):
                        st_transposed(dvl, [vl[L] + (2*kk+(q>>1))*V8 + 8*(q&1) for L in range(32)], [wv[L][q] for L in range(32)], KS == 1 or (kk & 1) == kh)
                    va[kk] = [[(-wv[L][q][0], -wv[L][q][1]) for q in range(4)] for L in range(32)]
                for kk in range(4):
                    for n2 in range(KW//16):
                        b = frag_b_kn(sm, bb+b_w, LDK, 16*kk, k0+16*n2)
                        mma([D[wp][L][2*n2] for L in range(32)], va[kk], [b[L][0] for L in range(32)], [b[L][1] for L in range(32)])
                        mma([D[wp][L][2*n2+1] for L in range(32)], va[kk], [b[L][2] for L in range(32)], [b[L][3] for L in range(32)])
        wait(0)
        for wp, (grp, kh) in enumerate(warps):
            vw = vs*BV + 16*grp; k0 = kh*KW
            for L in range(32):
                for nt in range(NKT):
                    for e in range(4):
                        dh0[state_off + (k0+8*nt+2*(L%4)+(e&1))*V + vw + L//4 + 8*(e>>1)] = D[wp][L][nt][e]
    got = dh0.reshape(HV, K, V)[j]
    rel = lambda a, b: np.linalg.norm(a-b)/np.linalg.norm(b)
    # only head j's chunks were touched
    m_dsl = out_dsl.reshape(nct, HV, K, V)[chunk0:chunk0+nch, j]; g_dsl = dsl.reshape(nct, HV, K, V)[chunk0:chunk0+nch, j]
    m_dvl = out_dvl.reshape(nct, HV, 64, V)[chunk0:chunk0+nch, j]; g_dvl = dvl.reshape(nct, HV, 64, V)[chunk0:chunk0+nch, j]
    other_ok = np.array_equal(np.delete(dsl.reshape(nct, HV, K, V), j, axis=1), np.delete(dsl0.reshape(nct, HV, K, V), j, axis=1))
    r = (rel(got, ref_dh0), rel(g_dsl, m_dsl), rel(g_dvl, m_dvl), np.mean(g_dsl != m_dsl), np.mean(g_dvl != m_dvl))
    print(f"K={K} V={V} NW={NW} KS={KS} NS={NS} nch={nch} last={lens_last}: rel dh0 {r[0]:.2e} dS_next {r[1]:.2e} dVn {r[2]:.2e}"
          f" (bf16 mismatch frac {r[3]:.3f} {r[4]:.3f}) nan={np.isnan(got).any()} others_untouched={other_ok}")
    return r

if __name__ == "__main__":
    # (K, V, NW, KS, NS, chunks, tokens in the last chunk); bv = 16 NW
    cfgs = [(128, 64, 1, 2, 4, 3, 40), (128, 64, 2, 2, 4, 2, 64), (128, 64, 1, 1, 3, 3, 17),
            (64, 64, 4, 1, 2, 3, 1), (64, 64, 2, 2, 2, 2, 33), (128, 64, 4, 2, 3, 5, 9),
            (128, 128, 2, 2, 4, 4, 63), (64, 128, 1, 2, 4, 3, 64), (128, 128, 4, 1, 3, 3, 2)]
    worst = 0.0
    for c in cfgs:
        r = run(*c, H=2, HV=4, j=3, seed=1)
        worst = max(worst, r[0])
    print("worst rel dh0 %.1e: %s" % (worst, "OK" if worst < 1e-5 else "FAILED"))
    sys.exit(0 if worst < 1e-5 else 1)
