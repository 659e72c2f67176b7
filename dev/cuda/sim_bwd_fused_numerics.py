"""Numerics of a fused backward (issue 8's plan, benchmarks/NOTES.md), simulated in NumPy.

The per-chunk equations of dev/cuda/derive_bwd_fused_check.py (one reverse walk per
sequence and head, gradients from the chunk start state h, dO and the chunk), with the
roundings a wgmma kernel would have: bf16 tensor-core operands, float32 accumulation,
h stored in bf16 by the forward chain, A'' = A diag(beta) stored in bf16 (as the
fused forward's stage A stores it; option a = "a": A itself stored in bf16 and beta
applied to Y's rows, the form of branch astore and of derive_bwd_fused_check.py). Compared with the float64 reference backward
(flashqla.reference.backward) on model-like inputs (DESIGN §3) against the project's
bf16 tolerances. Options choose the precision of the intermediates that feed products:

    PYTHONPATH=. python dev/cuda/sim_bwd_fused_numerics.py
"""
import sys

import numpy as np

sys.path.insert(0, "tests")
sys.path.insert(0, "dev/cuda")
from gdn_testing import make_inputs, rel_error  # noqa: E402
from flashqla import reference  # noqa: E402
from sim_fwd_fused_numerics import bf16, f32, inv_blocked_bf16  # noqa: E402


def split(x):
    """x as a bf16 part plus a bf16 remainder (two products instead of one)."""
    h = bf16(x)
    return h, bf16(x - h)


def mm(a, b, split_b):
    """a @ b with bf16 operands, b in two bf16 parts when split_b."""
    if split_b:
        bh, bl = split(b)
        return bf16(a) @ bh + bf16(a) @ bl
    return bf16(a) @ bf16(b)


def head_backward(q, k, v, g, beta, h0, do, dht, scale, opt):
    """One sequence, one head: q, k [T, K], v, do [T, V] (bf16 values), g, beta [T]."""
    T, K = q.shape
    chunks = [(c, min(T, c + 64)) for c in range(0, T, 64)]
    pre = []
    S = f32(h0).copy()
    for (t0, t1) in chunks:  # the forward chain, as the fused forward computes it
        Kc, Vc = f32(k[t0:t1]), f32(v[t0:t1])
        gam = np.cumsum(f32(g[t0:t1]), dtype=np.float32)
        b = f32(beta[t0:t1])
        n = t1 - t0
        Gam = np.exp(np.minimum(gam[:, None] - gam[None, :], 0)).astype(np.float32) * np.tri(n, dtype=np.float32)
        KKG = (Kc @ Kc.T) * Gam
        L = np.tril(b[:, None] * KKG, -1).astype(np.float32)
        A = inv_blocked_bf16(L)
        aform = opt.get("a") == "a"
        A2 = bf16(A) if aform else bf16(A * b[None, :])  # the stored operand
        hb = bf16(S)  # h as the forward chain stores it
        X = Kc @ hb
        Y = Vc - np.exp(gam)[:, None] * X
        if aform:
            Y = b[:, None] * Y
        Yh, Yl = split(Y)
        Vn = A2 @ Yh + A2 @ Yl
        kd = np.exp(gam[-1] - gam).astype(np.float32)
        S = np.exp(gam[-1]) * S + Kc.T @ bf16(kd[:, None] * Vn)
        pre.append((hb, gam, Gam, KKG, L, A, A2))
    dq, dk = np.zeros(q.shape, np.float32), np.zeros(k.shape, np.float32)
    dv = np.zeros(v.shape, np.float32)
    dg, dbeta = np.zeros(T, np.float32), np.zeros(T, np.float32)
    dSn = f32(dht).copy()
    for ci in reversed(range(len(chunks))):
        t0, t1 = chunks[ci]
        hb, gam, Gam, KKG, L, A, A2 = pre[ci]
        Qc, Kc, Vc, dOc = f32(q[t0:t1]), f32(k[t0:t1]), f32(v[t0:t1]), f32(do[t0:t1])
        b = f32(beta[t0:t1])
        eg, gC = np.exp(gam).astype(np.float32), gam[-1]
        kd = np.exp(gC - gam).astype(np.float32)
        # recomputed: Y, Vn from the stored h (bf16) as the forward formed them
        X = Kc @ hb
        Y0 = Vc - eg[:, None] * X
        Y = b[:, None] * Y0 if aform else Y0
        Yh, Yl = split(Y)
        Vn = A2 @ Yh + A2 @ Yl
        P = scale * (Qc @ Kc.T) * Gam
        # O = scale diag(e^g) Q S + P Vn
        split_dS = opt["dS"] == "split"  # how dS' enters its two products
        KdS = mm(Kc, dSn, split_dS)
        dVn = bf16(P).T @ dOc + kd[:, None] * KdS
        Vnb = bf16(Vn)
        dP = dOc @ Vnb.T
        dQ = scale * eg[:, None] * (dOc @ hb.T)
        dgam = scale * eg * ((Qc @ hb) * dOc).sum(1)
        Z = dP * P
        dgam = dgam + Z.sum(1) - Z.sum(0)
        dPG = scale * dP * Gam
        dQ = dQ + bf16(dPG) @ Kc
        dK = bf16(dPG).T @ Qc
        # S' = e^gC S + K^T diag(kd) Vn
        dS = scale * bf16(eg[:, None] * Qc).T @ dOc + np.exp(gC) * dSn
        VdS = mm(Vnb, dSn.T, split_dS)
        dK = dK + kd[:, None] * VdS
        xs = kd * (KdS * Vn).sum(1)
        dgam = dgam - xs
        dgam[-1] += xs.sum() + np.exp(gC) * (hb * dSn).sum()
        # Vn = A'' Y
        if opt["dvn"] == "split":  # dVn (and Y) in two bf16 parts each
            dVh, dVl = split(dVn)
            dVnb = dVh + dVl
            dA2 = dVnb @ (Yh + Yl).T
        else:
            dVnb = bf16(dVn)
            dA2 = dVnb @ bf16(Y).T
        dY = A2.T @ dVnb
        if aform:  # Y = diag(beta) Y0: Vn = A Y, dA = dVn Y^T directly
            db_y = (dY * Y0).sum(1)
            dY = b[:, None] * dY
        # Y = V - diag(e^g) K S
        edY = eg[:, None] * dY
        dS = dS - Kc.T @ bf16(edY)
        dK = dK - bf16(edY) @ hb.T
        dgam = dgam - eg * (X * dY).sum(1)
        # A'' = A diag(beta); A = (I + L)^-1; L = strict_lower(diag(beta) (K K^T . Gamma))
        if aform:
            db, dA = db_y, dA2
        else:
            db = (A * dA2).sum(0)
            dA = dA2 * b[None, :]
        dL = -np.tril(bf16(A).T @ bf16(bf16(dA) @ bf16(A).T), -1)
        db = db + (dL * KKG).sum(1)
        Hm = b[:, None] * dL * Gam
        dK = dK + bf16(Hm) @ Kc + bf16(Hm).T @ Kc
        ZL = dL * L
        dgam = dgam + ZL.sum(1) - ZL.sum(0)
        dg[t0:t1] = np.cumsum(dgam[::-1])[::-1]
        dbeta[t0:t1], dv[t0:t1], dq[t0:t1], dk[t0:t1] = db, dY, dQ, dK
        dSn = dS
    return dq, dk, dv, dg, dbeta, dSn


def run(opt, T=2048, HV=2, seed=1):
    inp = make_inputs(1, T, 1, HV, 128, 128, seed=seed, dht=True)
    q, k, v, do = (bf16(inp[n]).astype(np.float64) for n in ("q", "k", "v", "do"))
    g, beta = inp["g"].astype(np.float32), inp["beta"].astype(np.float32)
    h0, dht = inp["h0"].astype(np.float32), inp["dht"].astype(np.float32)
    scale = 128 ** -0.5
    ref = reference.backward(q, k, v, g.astype(np.float64), beta.astype(np.float64), do,
                             dfinal_state=dht.astype(np.float64), scale=scale,
                             initial_state=h0.astype(np.float64))
    got = [np.zeros_like(r) for r in ref]
    for j in range(HV):
        r = head_backward(f32(q[0, :, 0]), f32(k[0, :, 0]), f32(v[0, :, j]), g[0, :, j], beta[0, :, j],
                          h0[0, j], f32(do[0, :, j]), dht[0, j], scale, opt)
        got[0][0, :, 0] += r[0]
        got[1][0, :, 0] += r[1]
        got[2][0, :, j], got[3][0, :, j], got[4][0, :, j], got[5][0, j] = r[2], r[3], r[4], r[5]
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    return {n: rel_error(a, b) for n, a, b in zip(names, got, ref)}


if __name__ == "__main__":
    tol = {n: reference.tolerance("bfloat16", n) for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0")}
    print("tolerances", " ".join(f"{n} {t:.0e}" for n, t in tol.items()))
    for opt in ({"dS": "bf16", "dvn": "bf16"},
                {"dS": "split", "dvn": "bf16"},
                {"dS": "bf16", "dvn": "split"},
                {"dS": "bf16", "dvn": "bf16", "a": "a"}):
        for T, seed in ((2048, 1), (2048, 2)):
            e = run(opt, T=T, seed=seed)
            worst = max(e[n] / tol[n] for n in e)
            print(opt, f"T {T} seed {seed}", " ".join(f"{n} {x:.2e}" for n, x in e.items()),
                  f"| worst / tol {worst:.2f}")
