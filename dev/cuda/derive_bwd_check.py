"""
derive_bwd_check.py -- float64 check of the chunked GDN backward that the CUDA
backend (csrc/cuda/gdn_cuda_bwd.cu) implements, stage by stage, against torch
autograd through the plain token-by-token recurrence (DESIGN.md §1).

    /tmp/venv/bin/python dev/cuda/derive_bwd_check.py

Each stage below mirrors one CUDA kernel of gdn_cuda_bwd.cu (same names, same
equations), so a wrong formula shows up here first, in float64.
"""
import sys

import torch

torch.set_default_dtype(torch.float64)
EPS = 1e-6


def l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + EPS)


def l_backward(A, dA, L, KKG, b, Gam, Kc):
    """The steps shared by both backward forms, from dA (A = (I + L)^-1):
    forward A = (I + L)^-1:  dL = -strict_lower(A^T dA A^T);
    forward L = strict_lower(diag(b) (K K^T . Gam)):
        db_r += sum_s dL_rs KKG_rs,  dK += (Hm + Hm^T) K with Hm = diag(b) dL . Gam,
        dgamma += rowsum(dL . L) - colsum(dL . L).
    Returns the increments (db, dK, dgamma)."""
    dL = -(A.T @ dA @ A.T).tril(-1)
    Hm = b[:, None] * dL * Gam
    Z = dL * L
    return (dL * KKG).sum(1), Hm @ Kc + Hm.T @ Kc, Z.sum(1) - Z.sum(0)


def finish_qk(dq_part, dk_part, rq, rk, l2norm, H, G):
    """Stage 6 (qk_group_reduce): the GVA sum of the per-value-head parts, then
    the L2-norm backward q_hat = q r, r = (|q|^2 + eps)^-1/2:
    dq = r (dq_hat - q_hat (q_hat . dq_hat)). rq, rk: the raw q, k."""
    T, _, K = dq_part.shape
    dq = dq_part.view(T, H, G, K).sum(2)
    dk = dk_part.view(T, H, G, K).sum(2)
    if l2norm:
        for (x, dx) in ((rq, dq), (rk, dk)):
            r = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) + EPS)
            xh = x * r
            dx.copy_(r * (dx - xh * (xh * dx).sum(-1, keepdim=True)))
    return dq, dk


def recurrence(q, k, v, g, beta, scale, h0, l2norm):
    """Token-by-token forward of one sequence. q,k [T,H,K], v [T,HV,V],
    g, beta [T,HV], h0 [HV,K,V]. Returns o [T,HV,V], ht [HV,K,V]."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    if l2norm:
        q, k = l2n(q), l2n(k)
    outs, finals = [], []
    for j in range(HV):
        h = j // G
        S = h0[j]
        oj = []
        for t in range(T):
            a = torch.exp(g[t, j])
            u = beta[t, j] * (v[t, j] - a * (S.T @ k[t, h]))
            S = a * S + torch.outer(k[t, h], u)
            oj.append(scale * (S.T @ q[t, h]))
        outs.append(torch.stack(oj) if T else torch.zeros(0, V))
        finals.append(S)
    return torch.stack(outs, 1), torch.stack(finals)


def chunk_bwd(q, k, v, g, beta, scale, h0, l2norm, do, dht, C):
    """Chunked backward of one sequence, in the order of the CUDA kernels."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    rq, rk = q, k
    if l2norm:
        q, k = l2n(q), l2n(k)
    NT = (T + C - 1) // C
    dq_part = torch.zeros(T, HV, K)
    dk_part = torch.zeros(T, HV, K)
    dv = torch.zeros(T, HV, V)
    dbeta = torch.zeros(T, HV)
    dg = torch.zeros(T, HV)
    dh0 = torch.zeros(HV, K, V)
    for j in range(HV):
        hh = j // G
        chunks = [(c * C, min(T, c * C + C)) for c in range(NT)]
        # ---- stage 1 (wy_recompute): gamma, L, A, W, U per chunk
        st1 = []
        for (t0, t1) in chunks:
            Kc, Vc = k[t0:t1, hh], v[t0:t1, j]
            gam = torch.cumsum(g[t0:t1, j], 0)
            b = beta[t0:t1, j]
            n = t1 - t0
            Gam = torch.exp(gam[:, None] - gam[None, :]).tril()  # only r >= s used
            L = (b[:, None] * (Kc @ Kc.T) * Gam).tril(-1)
            A = torch.linalg.inv(torch.eye(n) + L)
            W = A @ ((b * torch.exp(gam))[:, None] * Kc)
            U = A @ (b[:, None] * Vc)
            st1.append((gam, Gam, L, A, W, U))
        # ---- stage 2 (state_fwd): chunk-start states h, Vn
        S = h0[j].clone()
        hs, vns = [], []
        for ci, (t0, t1) in enumerate(chunks):
            gam, Gam, L, A, W, U = st1[ci]
            hs.append(S.clone())
            Vn = U - W @ S
            vns.append(Vn)
            gC = gam[-1]
            S = torch.exp(gC) * S + k[t0:t1, hh].T @ (torch.exp(gC - gam)[:, None] * Vn)
        # ---- stage 3 (chunk_local_bwd): dv_local, dQ, dK_O, dgamma_O
        st3 = []
        for ci, (t0, t1) in enumerate(chunks):
            gam, Gam, L, A, W, U = st1[ci]
            Qc, Kc, dOc = q[t0:t1, hh], k[t0:t1, hh], do[t0:t1, j]
            Vn, Sh = vns[ci], hs[ci]
            # forward: O = scale (diag(e^g) Q S + P Vn), P = lower_incl(Q K^T . Gam)
            P = (Qc @ Kc.T) * Gam
            dvloc = scale * P.T @ dOc
            dP = scale * (dOc @ Vn.T) * Gam          # masked: Gam is lower incl.
            dQ = scale * torch.exp(gam)[:, None] * (dOc @ Sh.T) + dP @ Kc
            dK = dP.T @ Qc
            dgam = scale * torch.exp(gam) * ((dOc @ Sh.T) * Qc).sum(1)
            Z = dP * (Qc @ Kc.T)                     # = dP_rs * P_rs / Gam * Gam
            dgam = dgam + Z.sum(1) - Z.sum(0)
            st3.append((dvloc, dQ, dK, dgam))
        # ---- stage 4 (state_bwd): reverse pass, dS_next per chunk, dVn, dh0
        dS = dht[j].clone()
        dSn, dvns = [None] * NT, [None] * NT
        for ci in reversed(range(NT)):
            t0, t1 = chunks[ci]
            gam, Gam, L, A, W, U = st1[ci]
            gC = gam[-1]
            dSn[ci] = dS.clone()
            # forward: S' = e^gC S + K^T diag(e^{gC-g}) Vn ; Vn = U - W S ; O = ..
            dVn = st3[ci][0] + torch.exp(gC - gam)[:, None] * (k[t0:t1, hh] @ dS)
            dvns[ci] = dVn
            dS = (torch.exp(gC) * dS + scale * (torch.exp(gam)[:, None] * q[t0:t1, hh]).T @ do[t0:t1, j]
                  - W.T @ dVn)
        dh0[j] = dS
        # ---- stage 5 (chunk_wy_bwd): dK, dV, dbeta, dgamma -> dg
        for ci, (t0, t1) in enumerate(chunks):
            gam, Gam, L, A, W, U = st1[ci]
            dvloc, dQ, dK, dgam = st3[ci]
            Kc, Vc, b = k[t0:t1, hh], v[t0:t1, j], beta[t0:t1, j]
            Sh, dSn_c, Vn, dVn = hs[ci], dSn[ci], vns[ci], dvns[ci]
            gC = gam[-1]
            m = torch.exp(gC - gam)
            # forward: S' = e^gC S + K^T diag(m) Vn
            dKs = m[:, None] * (Vn @ dSn_c.T)
            dK = dK + dKs
            x = (dKs * Kc).sum(1)                 # = m_r * k_r^T dS' vn_r
            dgam = dgam - x
            dgam[-1] += x.sum() + torch.exp(gC) * (Sh * dSn_c).sum()
            # forward: Vn = U - W S
            dW = -dVn @ Sh.T
            dU = dVn
            # forward: W = A diag(b e^g) K ; U = A diag(b) V
            eg = torch.exp(gam)
            dA = dW @ ((b * eg)[:, None] * Kc).T + dU @ (b[:, None] * Vc).T
            AtdW = A.T @ dW
            AtdU = A.T @ dU
            dK = dK + (b * eg)[:, None] * AtdW
            xw = (AtdW * Kc).sum(1)
            db = eg * xw + (AtdU * Vc).sum(1)
            dgam = dgam + b * eg * xw
            dVc = b[:, None] * AtdU
            # forward: A = (I + L)^-1, L = strict_lower(diag(b) (K K^T . Gam))
            ddb, ddK, ddgam = l_backward(A, dA, L, (Kc @ Kc.T) * Gam, b, Gam, Kc)
            db, dK, dgam = db + ddb, dK + ddK, dgam + ddgam
            # gamma = cumsum(g): dg = reverse cumsum(dgamma)
            dg[t0:t1, j] = torch.flip(torch.cumsum(torch.flip(dgam, [0]), 0), [0])
            dbeta[t0:t1, j] = db
            dv[t0:t1, j] = dVc
            dq_part[t0:t1, j] = dQ
            dk_part[t0:t1, j] = dK
    # ---- stage 6 (qk_group_reduce): GVA sum, l2norm backward
    dq, dk = finish_qk(dq_part, dk_part, rq, rk, l2norm, H, G)
    return dq, dk, dv, dg, dbeta, dh0


def rel(a, b):
    return (torch.linalg.norm((a - b).flatten()) / max(torch.linalg.norm(b.flatten()), 1e-300)).item()


def one_case(T, H, HV, K, V, C, l2norm, use_h0, use_dht, seed, bwd=None):
    """Relative errors of bwd (default chunk_bwd; same signature) against autograd."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = rn(T, H, K), rn(T, H, K), rn(T, HV, V)
    if not l2norm:
        q, k = l2n(q), l2n(k)
    Ah = torch.linspace(0, 4, HV)
    g = -Ah[None, :] * torch.nn.functional.softplus(0.5 * rn(T, HV) + 1)
    beta = torch.sigmoid(rn(T, HV))
    h0 = rn(HV, K, V) * 0.5 if use_h0 else torch.zeros(HV, K, V)
    do, dht = rn(T, HV, V), (rn(HV, K, V) if use_dht else torch.zeros(HV, K, V))
    scale = K ** -0.5
    ins = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = recurrence(*ins[:5], scale, ins[5], l2norm)
    loss = (o * do).sum() + (ht * dht).sum()
    ref = torch.autograd.grad(loss, ins)
    got = (bwd or chunk_bwd)(q, k, v, g, beta, scale, h0, l2norm, do, dht, C)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    order = [0, 1, 2, 3, 4, 5]
    errs = {names[i]: rel(got[i], ref[order[i]]) for i in range(6)}
    return errs


CASES = [
    dict(T=37, H=1, HV=2, K=8, V=8, C=16, l2norm=False, use_h0=True, use_dht=True),
    dict(T=50, H=2, HV=4, K=8, V=12, C=16, l2norm=True, use_h0=False, use_dht=False),
    dict(T=16, H=1, HV=1, K=8, V=8, C=16, l2norm=True, use_h0=True, use_dht=False),
    dict(T=1, H=1, HV=2, K=8, V=8, C=16, l2norm=False, use_h0=True, use_dht=True),
    dict(T=70, H=1, HV=2, K=16, V=16, C=64, l2norm=True, use_h0=True, use_dht=True),
]


def main(bwd=None, what="the chunked backward equations match autograd through the recurrence"):
    """Every case of CASES through bwd (default chunk_bwd); exits 1 past 1e-10."""
    worst = 0.0
    for i, c in enumerate(CASES):
        errs = one_case(seed=i, bwd=bwd, **c)
        worst = max(worst, max(errs.values()))
        print(c, " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    print(f"worst rel err {worst:.3e}")
    if not worst < 1e-10:
        print("FAIL")
        sys.exit(1)
    print("OK: " + what)


if __name__ == "__main__":
    main()
