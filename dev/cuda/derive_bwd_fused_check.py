"""
derive_bwd_fused_check.py -- float64 check of the backward in the form a fused
backward kernel computes it (benchmarks/NOTES.md, "Issue 8: the shape of a fused
backward"): per (sequence, value head) ONE reverse walk over the chunks, carrying
dS, that forms every per-chunk gradient from the chunk's own inputs, its start
state h (saved or recomputed by the forward chain) and dO -- in the fused
forward's variables (gdn_cuda_fwd_fused.cu), with no W, U or stored Vn, dVn:

    A   = (I + L)^-1,  L = strict_lower(diag(beta) (K K^T . Gamma))
    Y   = diag(beta) (V - diag(e^gamma) K S),   Vn = A Y
          (beta on Y's rows, A itself stored: the form of the fused forward at
          branch astore, and the one the L backward needs: A^T dA A^T)
    P   = scale lower_incl(Q K^T . Gamma)
    O   = scale diag(e^gamma) Q S + P Vn
    S'  = e^{gamma_C} S + K^T diag(kd) Vn,  kd = e^{gamma_C - gamma}

Checked against torch autograd through the token-by-token recurrence by
derive_bwd_check.py's cases and driver:

    /tmp/venv/bin/python dev/cuda/derive_bwd_fused_check.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import derive_bwd_check  # noqa: E402
from derive_bwd_check import finish_qk, l2n, l_backward  # noqa: E402

torch.set_default_dtype(torch.float64)


def fused_bwd(q, k, v, g, beta, scale, h0, l2norm, do, dht, C):
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    rq, rk = q, k
    if l2norm:
        q, k = l2n(q), l2n(k)
    NT = (T + C - 1) // C
    chunks = [(c * C, min(T, c * C + C)) for c in range(NT)]
    dq_part, dk_part = torch.zeros(T, HV, K), torch.zeros(T, HV, K)
    dv, dbeta, dg = torch.zeros(T, HV, V), torch.zeros(T, HV), torch.zeros(T, HV)
    dh0 = torch.zeros(HV, K, V)
    for j in range(HV):
        hh = j // G
        # the forward chain: chunk-start states h (what the fused kernel's h mode stores)
        S = h0[j].clone()
        hs = []
        for (t0, t1) in chunks:
            hs.append(S.clone())
            Kc, Vc, b = k[t0:t1, hh], v[t0:t1, j], beta[t0:t1, j]
            gam = torch.cumsum(g[t0:t1, j], 0)
            n = t1 - t0
            Gam = torch.exp(gam[:, None] - gam[None, :]).tril()
            A = torch.linalg.inv(torch.eye(n) + (b[:, None] * (Kc @ Kc.T) * Gam).tril(-1))
            Vn = (A * b[None, :]) @ (Vc - torch.exp(gam)[:, None] * (Kc @ S))
            S = torch.exp(gam[-1]) * S + Kc.T @ (torch.exp(gam[-1] - gam)[:, None] * Vn)
        # the reverse walk: dS' (the gradient of the state after the chunk) carried
        dSn = dht[j].clone()
        for ci in reversed(range(NT)):
            t0, t1 = chunks[ci]
            Qc, Kc, Vc, dOc = q[t0:t1, hh], k[t0:t1, hh], v[t0:t1, j], do[t0:t1, j]
            b, Sh = beta[t0:t1, j], hs[ci]
            n = t1 - t0
            # recomputed per chunk, as the kernel would: gamma, Gamma, L, A, A'', Y, Vn, P
            gam = torch.cumsum(g[t0:t1, j], 0)
            eg, gC = torch.exp(gam), gam[-1]
            kd = torch.exp(gC - gam)
            Gam = torch.exp(gam[:, None] - gam[None, :]).tril()
            KKG = (Kc @ Kc.T) * Gam
            L = (b[:, None] * KKG).tril(-1)
            A = torch.linalg.inv(torch.eye(n) + L)
            X = Kc @ Sh                                    # X = K S
            Y0 = Vc - eg[:, None] * X
            Y = b[:, None] * Y0                            # beta on Y's rows
            Vn = A @ Y
            QK = Qc @ Kc.T
            P = scale * QK * Gam                           # lower incl. (Gam is)
            # O = scale diag(e^g) Q S + P Vn
            dVn = P.T @ dOc
            dP = dOc @ Vn.T
            QS = Qc @ Sh
            dQ = scale * eg[:, None] * (dOc @ Sh.T)
            dS = scale * (eg[:, None] * Qc).T @ dOc
            dgam = scale * eg * (QS * dOc).sum(1)
            # P = scale lower_incl(Q K^T . Gamma)
            Z = dP * P                                     # d gamma through Gamma
            dgam = dgam + Z.sum(1) - Z.sum(0)
            dPG = scale * dP * Gam
            dQ = dQ + dPG @ Kc
            dK = dPG.T @ Qc
            # S' = e^{gC} S + K^T diag(kd) Vn
            dS = dS + torch.exp(gC) * dSn
            KdS = Kc @ dSn                                 # n x V
            dVn = dVn + kd[:, None] * KdS
            dK = dK + kd[:, None] * (Vn @ dSn.T)
            xs = kd * (KdS * Vn).sum(1)                    # d kd_r * kd_r
            dgam = dgam - xs
            dgam[-1] = dgam[-1] + xs.sum() + torch.exp(gC) * (Sh * dSn).sum()
            # Vn = A Y
            dA = dVn @ Y.T
            dYb = A.T @ dVn
            # Y = diag(beta) Y0
            db = (dYb * Y0).sum(1)
            dY = b[:, None] * dYb
            # Y0 = V - diag(e^g) K S
            dVc = dY
            edY = eg[:, None] * dY
            dS = dS - Kc.T @ edY
            dK = dK - edY @ Sh.T
            dgam = dgam - eg * (X * dY).sum(1)
            # A = (I + L)^-1, L = strict_lower(diag(beta) (K K^T . Gamma))
            ddb, ddK, ddgam = l_backward(A, dA, L, KKG, b, Gam, Kc)
            db, dK, dgam = db + ddb, dK + ddK, dgam + ddgam
            # gamma = cumsum(g)
            dg[t0:t1, j] = torch.flip(torch.cumsum(torch.flip(dgam, [0]), 0), [0])
            dbeta[t0:t1, j] = db
            dv[t0:t1, j] = dVc
            dq_part[t0:t1, j] = dQ
            dk_part[t0:t1, j] = dK
            dSn = dS                                        # the previous chunk's dS'
        dh0[j] = dSn
    dq, dk = finish_qk(dq_part, dk_part, rq, rk, l2norm, H, G)
    return dq, dk, dv, dg, dbeta, dh0


if __name__ == "__main__":
    derive_bwd_check.main(fused_bwd, "the fused-form backward (one reverse walk, gradients from h, dO and the "
                          "chunk) matches autograd")
