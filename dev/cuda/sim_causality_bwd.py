"""
sim_causality_bwd.py -- float64 simulation of the causality handling (issue 9)
of the CUDA backward's recompute and kernels (gdn_cuda_fwd_wy.cu blocked /
persistent, gdn_cuda_bwd_fused.cu bwd_local / bwd_wy), against the NaN
pattern of the token-by-token reference (flashqla.reference).

    /tmp/venv/bin/python dev/cuda/sim_causality_bwd.py

Dense products here multiply 0 * NaN like the tensor cores do; the selects
and cuts are the kernels' (stage A: L's non-finite entries zeroed, fl from
them, fv from the V rows, K rows >= fl / fw, V rows >= f / beta zeroed; the
persistent kernel (the backward's recompute) also scans g' = isfinite(g) ? g
: 0, tg = the first row of a non-finite g, and stores W's rows >= min(fl, tg)
as NaN; bwd_local: lower_incl by selects, K's non-finite elements zeroed,
dv_local = scale P^T dO last, from dO with its non-finite elements zeroed;
bwd_wy: V's non-finite elements zeroed, dVn's too unless the chunk's gamma_C
is not finite, dA's non-finite entries zeroed). The check: wherever the
reference gradient is finite, the simulated one is finite and equal to it
(float64, 1e-9), every gradient, every token, for a NaN in v, k, beta, g, do
(g also at a chunk's first and last row, in the short last chunk, in chunk
0, twice in one chunk, in two chunks) and none; dh0 NaN wherever the
reference's is, and for k, beta, g the recomputed state after the chunk not
finite anywhere; o before the token exact, o from it on and the final state
NaN in the three-stage forward (gamma poisoned from row f on).
"""
import sys
import warnings

import numpy as np

import importlib.util  # noqa: E402
import os  # noqa: E402

_spec = importlib.util.spec_from_file_location(  # flashqla/reference.py alone (no built extension needed)
    "fq_reference", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashqla", "reference.py"))
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)


def fin0(x):
    return np.where(np.isfinite(x), x, 0.0)


def stage_a(Kc, Vc, gam, b, poison):
    """Blocked / persistent stage A of one chunk: A, W, U, stored gamma, fl."""
    n = len(gam)
    with np.errstate(all="ignore"):
        X = b[:, None] * (Kc @ Kc.T) * np.exp(gam[:, None] - gam[None, :])
    r, c = np.indices((n, n))
    badL = (c <= r) & ~np.isfinite(X)
    rows = np.flatnonzero(badL.any(1))
    fl = rows[0] if len(rows) else 64
    L = np.where((c < r) & np.isfinite(X), X, 0.0)
    vrows = np.flatnonzero((~np.isfinite(Vc)).any(1))
    f = min(fl, vrows[0] if len(vrows) else 64)
    A = np.linalg.inv(np.eye(n) + L)
    with np.errstate(all="ignore"):
        fw = b * np.exp(gam)
    idx = np.arange(n)
    K2 = np.where((idx >= fl)[:, None], 0.0, Kc)
    fw2 = np.where(idx >= fl, 0.0, fw)
    V2 = np.where((idx >= f)[:, None], 0.0, Vc)
    b2 = np.where(idx >= f, 0.0, b)
    W = (A * fw2[None, :]) @ K2
    U = (A * b2[None, :]) @ V2
    gout = np.where(poison & (idx >= f), np.nan, gam)
    return A, W, U, gout, fl


def forward_three_stage(q, k, v, g, beta, scale, h0, C=64):
    T, K = q.shape
    o = np.zeros_like(v)
    S = h0.copy()
    with np.errstate(all="ignore"):
        for t0 in range(0, T, C):
            t1 = min(T, t0 + C)
            Kc, Vc, Qc = k[t0:t1], v[t0:t1], q[t0:t1]
            gam = np.cumsum(g[t0:t1])
            A, W, U, gs, _ = stage_a(Kc, Vc, gam, beta[t0:t1], True)
            Vn = U - W @ S                                  # stage B
            kdec = np.exp(gam[-1] - gam)
            S_next = np.exp(gs[-1]) * S + Kc.T @ (kdec[:, None] * Vn)
            n = t1 - t0
            r, c = np.indices((n, n))
            P = np.where(c <= r, (Qc @ Kc.T) * np.exp(gs[:, None] - gs[None, :]), 0.0)  # stage C
            o[t0:t1] = scale * (np.exp(gs)[:, None] * (Qc @ S) + P @ Vn)
            S = S_next
    return o, S


def backward(q, k, v, g, beta, scale, h0, do, dht, C=64):
    """One value head, H = HV = 1: the CUDA backward's stages with the kernels' selects."""
    T, K = q.shape
    chunks = [(t0, min(T, t0 + C)) for t0 in range(0, T, C)]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg, dbeta = np.zeros(T), np.zeros(T)
    with np.errstate(all="ignore"):
        st1 = []
        for (t0, t1) in chunks:
            # persistent stage A (the recompute): the gate scan on g' = isfinite(g) ? g : 0 (warp 0's
            # select; its ballot gives tg, the chunk's first row with a non-finite g, 64: none) ...
            gc = g[t0:t1]
            bad = np.flatnonzero(~np.isfinite(gc))
            tg = bad[0] if len(bad) else 64
            gam = np.cumsum(np.where(np.isfinite(gc), gc, 0.0))
            A, W, U, _, fl = stage_a(k[t0:t1], v[t0:t1], gam, beta[t0:t1], False)
            # ... and, rare path, W's rows from min(fl, tg) on (a non-finite k, beta, rk or g) stored
            # as NaN, so Vn = U - W h there, the state after the chunk and bwd_state's W^T dVn (dh0)
            # are NaN as the reference's (nothing the reference has finite reads those rows)
            W = np.where((np.arange(t1 - t0) >= min(fl, tg))[:, None], np.nan, W)
            st1.append((gam, A, W, U))
        S, hs, vns = h0.copy(), [], []
        for ci, (t0, t1) in enumerate(chunks):                       # stage B
            gam, A, W, U = st1[ci]
            hs.append(S.copy())
            Vn = U - W @ S
            vns.append(Vn)
            S = np.exp(gam[-1]) * S + k[t0:t1].T @ (np.exp(gam[-1] - gam)[:, None] * Vn)
        hs.append(S.copy())                                          # the state after the last chunk
        st3 = []
        for ci, (t0, t1) in enumerate(chunks):                       # bwd_local
            gam = st1[ci][0]
            Qc, Kc, dOc, Vn, Sh = q[t0:t1], fin0(k[t0:t1]), do[t0:t1], vns[ci], hs[ci]
            n = t1 - t0
            r, c = np.indices((n, n))
            Gm = np.exp(gam[:, None] - gam[None, :])
            QK = Qc @ Kc.T
            P = np.where(c <= r, QK * Gm, 0.0)
            dP = np.where(c <= r, scale * (dOc @ Vn.T) * Gm, 0.0)
            Z = np.where(c <= r, dP * QK, 0.0)
            F = scale * np.exp(gam)[:, None] * (dOc @ Sh.T)
            dQ = F + dP @ Kc
            dKO = dP.T @ Qc
            dgam = (F * Qc).sum(1) + Z.sum(1) - Z.sum(0)
            dSl = (scale * np.exp(gam)[:, None] * Qc).T @ dOc
            # dv_local last, from dO with its non-finite elements zeroed (rare path)
            st3.append((scale * P.T @ fin0(dOc), dQ, dKO, dgam, dSl))
        dS = dht.copy()
        dSn, dvns = [None] * len(chunks), [None] * len(chunks)
        for ci in reversed(range(len(chunks))):                      # bwd_state
            t0, t1 = chunks[ci]
            gam, A, W, U = st1[ci]
            dSn[ci] = dS.copy()
            dVn = st3[ci][0] + np.exp(gam[-1] - gam)[:, None] * (k[t0:t1] @ dS)
            dvns[ci] = dVn
            dS = np.exp(gam[-1]) * dS + st3[ci][4] - W.T @ dVn
        dh0 = dS
        for ci, (t0, t1) in enumerate(chunks):                       # bwd_wy
            gam, A, W, U = st1[ci]
            _, dQ, dKO, dgam, _ = st3[ci]
            Kc, Vc, b = k[t0:t1], fin0(v[t0:t1]), beta[t0:t1]
            # dVn's non-finite elements zeroed, unless the chunk's gamma_C is not finite (a NaN g: dv stays NaN)
            Sh, dSc, Vn, dVn = hs[ci], dSn[ci], vns[ci], fin0(dvns[ci]) if np.isfinite(gam[-1]) else dvns[ci]
            n = t1 - t0
            r, c = np.indices((n, n))
            m = np.exp(gam[-1] - gam)
            F1 = Vn @ dSc.T
            dK = dKO + m[:, None] * F1
            x = m * (F1 * Kc).sum(1)
            dgam = dgam.copy() - x
            dgam[-1] += x.sum() + np.exp(gam[-1]) * (Sh * dSc).sum()
            dW = -dVn @ Sh.T
            eg = np.exp(gam)
            AtdW, AtdU = A.T @ dW, A.T @ dVn
            dK = dK + (b * eg)[:, None] * AtdW
            xw = (AtdW * Kc).sum(1)
            db = eg * xw + (AtdU * Vc).sum(1)
            dgam = dgam + b * eg * xw
            dA = fin0(dW @ ((b * eg)[:, None] * Kc).T + dVn @ (b[:, None] * Vc).T)  # non-finite entries zeroed
            M2 = (A.T @ dA) @ A.T
            Gm = np.exp(gam[:, None] - gam[None, :])
            dL = np.where(r > c, -M2, 0.0)
            y = np.where(r > c, dL * (Kc @ Kc.T) * Gm, 0.0)
            db = db + y.sum(1)
            z = b[:, None] * y
            dgam = dgam + z.sum(1) - z.sum(0)
            Gl = np.where(r > c, b[:, None] * dL * Gm, 0.0)
            dK = dK + Gl @ Kc + Gl.T @ Kc
            dg[t0:t1] = np.cumsum(dgam[::-1])[::-1]   # a pure suffix sum, as bwd_wy: never (total or suffix) - prefix
            dbeta[t0:t1] = db
            dv[t0:t1] = b[:, None] * AtdU
            dq[t0:t1], dk[t0:t1] = dQ, dK
    return (dq, dk, dv, dg, dbeta, dh0), hs


def check(name, x, ref, tol=1e-9):
    fin = np.isfinite(ref)
    leak = fin & ~np.isfinite(x)
    if leak.any():
        return f"{name}: {int(leak.sum())} non-finite where the reference is finite (first {np.argwhere(leak)[0]})"
    if fin.any():
        e = np.linalg.norm((x - ref)[fin]) / max(np.linalg.norm(ref[fin]), 1e-300)
        if e > tol:
            return f"{name}: rel error {e:.2e} on the finite entries"
    return None


def main():
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    T, K, V = 150, 16, 16                   # chunks 0..127 (two) and 128..149 (short)
    # (field, tokens): 100 is row 36 of chunk 1; g also at a chunk's first row (128), its last
    # (127), in the short last chunk (140), in chunk 0 (5), twice in one chunk, in two chunks
    cases = [("v", [100]), ("k", [100]), ("beta", [100]), ("g", [100]), ("g", [128]), ("g", [127]),
             ("g", [140]), ("g", [5]), ("g", [100, 110]), ("g", [70, 130]), ("do", [100]), ("none", [])]
    fails = 0
    for field, toks in cases:
        q = rng.standard_normal((T, K)); k = rng.standard_normal((T, K))
        q /= np.linalg.norm(q, axis=1, keepdims=True); k /= np.linalg.norm(k, axis=1, keepdims=True)
        v = rng.standard_normal((T, V))
        g = -np.log1p(np.exp(0.5 * rng.standard_normal(T) + 1)) * 0.5
        beta = 1 / (1 + np.exp(-rng.standard_normal(T)))
        h0 = 0.5 * rng.standard_normal((K, V)); do = rng.standard_normal((T, V))
        dht = 0.5 * rng.standard_normal((K, V))
        for t in toks:
            if field in ("v", "k", "do"):
                {"v": v, "k": k, "do": do}[field][t, 1] = np.nan
            else:
                {"beta": beta, "g": g}[field][t] = np.nan
        t = toks[0] if toks else T
        scale = K ** -0.5
        ex = lambda x: x[None, :, None] if x.ndim == 1 else x[None, :, None, :]
        with np.errstate(all="ignore"):
            ro, rht = reference.forward(ex(q), ex(k), ex(v), ex(g), ex(beta), scale=scale,
                                        initial_state=h0[None, None])
            rg = reference.backward(ex(q), ex(k), ex(v), ex(g), ex(beta), ex(do), dfinal_state=dht[None, None],
                                    scale=scale, initial_state=h0[None, None])
        o, ht = forward_three_stage(q, k, v, g, beta, scale, h0)
        msgs = [check("o", o[:t], ro[0, :t, 0])] if field != "do" else [check("o", o, ro[0, :, 0])]
        if field not in ("none", "do"):
            msgs.append(None if np.isnan(o[t:]).any(1).all() else "o: a finite row from the NaN token on")
            msgs.append(None if np.isnan(ht).any() else "ht: finite")
        got, hs = backward(q, k, v, g, beta, scale, h0, do, dht)
        refs = [rg[0][0, :, 0], rg[1][0, :, 0], rg[2][0, :, 0], rg[3][0, :, 0], rg[4][0, :, 0], rg[5][0, 0]]
        for n, x, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, refs):
            msgs.append(check(n, x, r))
        # nothing silently wrong where it matters: dh0 NaN wherever the reference's is, and
        # the backward's recomputed state after the chunk of a NaN in k, beta, g not finite
        if (np.isnan(refs[5]) & np.isfinite(got[5])).any():
            msgs.append(f"dh0: {int((np.isnan(refs[5]) & np.isfinite(got[5])).sum())} finite where the reference is NaN")
        if field in ("k", "beta", "g") and np.isfinite(hs[t // 64 + 1]).any():
            msgs.append("the recomputed state after the NaN token's chunk has finite entries")
        msgs = [m for m in msgs if m]
        nfin = {n: int(np.isfinite(r).sum()) for n, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), refs)}
        print(f"NaN in {field:5s} at {str(toks):10s}: reference finite {nfin}: " + ("OK" if not msgs else "; ".join(msgs)))
        fails += bool(msgs)
    if fails:
        print("FAIL")
        sys.exit(1)
    print("OK: the simulated kernels are finite and exact wherever the reference is")


if __name__ == "__main__":
    main()
