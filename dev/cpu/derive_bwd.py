#!/usr/bin/env python3
"""derive_bwd.py — float64 NumPy derivation check of the chunked GDN backward.

What it checks (DESIGN.md §1, §2):

  (a) the chunked forward (C = 64) against the token-by-token recurrence
      (flashqla/reference.py, the project's float64 reference),
  (b) the hand-written chunked backward against central finite differences
      of that recurrence (directional derivatives along random directions),
  (c) the same backward against the reference's own reverse mode
      (reference.backward; q/k l2-normalisation included when use_qk_l2norm
      is set).

The chunked backward below is the one csrc/cpu/gdn_cpu_bwd.c implements (same
names, same equations; the C keeps W and Kb negated and reuses pass 1's Vn);
its equations are repeated at the top of that file. Both avoid two
cancellations that ruin dg under strong decay (see the comments at E and t).
Run:  make -C dev derive_bwd    (or: python3 dev/cpu/derive_bwd.py; needs NumPy only)
"""
import importlib.util
import os
import sys

import numpy as np

# flashqla/reference.py, loaded by path: it needs NumPy only, not a built flashqla
_spec = importlib.util.spec_from_file_location(
    "flashqla_reference", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                       "flashqla", "reference.py"))
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

CHUNK = 64
EPS = reference.L2NORM_EPS
TOL_F64 = reference.tolerance("float64", "o")   # (a) and (c): float64 against float64
FD_TOL = 1e-6   # (b): what central differences with h = 1e-6 resolve, not a kernel tolerance


# ----------------------------------------------------------------- reference
def l2norm(x):
    return reference.l2norm(x)[0]


def _one_head(x):
    """[T, D] -> [1, T, 1, D] (or [T] -> [1, T, 1]): one sequence, one head."""
    return x[None, :, None]


def recurrent_fwd(q, k, v, g, beta, scale, h0, use_l2):
    """One sequence, one value head. q,k [T,K], v [T,V], g,beta [T], h0 [K,V]:
    the reference's token-by-token recurrence."""
    o, S = reference.forward(_one_head(q), _one_head(k), _one_head(v), _one_head(g),
                             _one_head(beta), scale=scale, initial_state=h0[None, None],
                             use_qk_l2norm=use_l2)
    return o[0, :, 0], S[0, 0]


def recurrent_bwd(q, k, v, g, beta, scale, h0, do, dht, use_l2):
    """The reference's reverse mode for one sequence and value head."""
    grads = reference.backward(_one_head(q), _one_head(k), _one_head(v), _one_head(g),
                               _one_head(beta), _one_head(do), dfinal_state=dht[None, None],
                               scale=scale, initial_state=h0[None, None], use_qk_l2norm=use_l2)
    dq, dk, dv, dg, dbeta, dh0 = grads
    return dq[0, :, 0], dk[0, :, 0], dv[0, :, 0], dg[0, :, 0], dbeta[0, :, 0], dh0[0, 0]


# ---------------------------------------------------------- chunk forward
def chunk_local(Kc, Vc, gc, bc):
    """Everything of one chunk that does not depend on the state S."""
    c = Kc.shape[0]
    gam = np.cumsum(gc)                               # gamma_r = sum_{s<=r} g_s
    diff = gam[:, None] - gam[None, :]
    low_incl = np.tril(np.ones((c, c), bool))
    Gam = np.where(low_incl, np.exp(np.where(low_incl, diff, 0.0)), 0.0)  # Gamma_rs, r >= s
    KK = Kc @ Kc.T
    L = np.tril(bc[:, None] * KK * Gam, -1)           # L = strict_lower(diag(b)(K K^T o Gamma))
    A = np.linalg.inv(np.eye(c) + L)                  # A = (I + L)^-1
    eg = np.exp(gam)
    Kb = (bc * eg)[:, None] * Kc                      # diag(b e^gamma) K
    Vb = bc[:, None] * Vc                             # diag(b) V
    W = A @ Kb                                        # W = A diag(b e^gamma) K
    U = A @ Vb                                        # U = A diag(b) V
    return dict(gam=gam, Gam=Gam, KK=KK, L=L, A=A, eg=eg, Kb=Kb, Vb=Vb, W=W, U=U)


def chunk_fwd(q, k, v, g, beta, scale, h0, use_l2):
    if use_l2:
        q, k = l2norm(q), l2norm(k)
    T = q.shape[0]
    S = h0.copy()
    o = np.zeros_like(v)
    for c0 in range(0, T, CHUNK):
        sl = slice(c0, min(c0 + CHUNK, T))
        Q, Kc, Vc = q[sl], k[sl], v[sl]
        loc = chunk_local(Kc, Vc, g[sl], beta[sl])
        gam, Gam, W, U, eg = loc["gam"], loc["Gam"], loc["W"], loc["U"], loc["eg"]
        Vn = U - W @ S                                        # Vn = U - W S
        P = np.tril(Q @ Kc.T) * Gam                           # lower_incl(Q K^T o Gamma)
        o[sl] = scale * ((eg[:, None] * Q) @ S + P @ Vn)      # O = scale(diag(e^g) Q S + P Vn)
        kd = np.exp(gam[-1] - gam)
        S = np.exp(gam[-1]) * S + (kd[:, None] * Kc).T @ Vn   # S' = e^gC S + K^T diag(e^(gC-g)) Vn
    return o, S


# --------------------------------------------------------- chunk backward
def chunk_bwd(q, k, v, g, beta, scale, h0, do, dht, use_l2):
    """Returns dq, dk, dv, dg, dbeta, dh0 of  L = <o, do> + <S_T, dht>."""
    q_in, k_in = q, k
    if use_l2:
        q, k = l2norm(q), l2norm(k)
    T, K = q.shape
    V = v.shape[1]
    # pass 1 (forward over chunks): the start state of every chunk
    starts = []
    S = h0.copy()
    for c0 in range(0, T, CHUNK):
        sl = slice(c0, min(c0 + CHUNK, T))
        loc = chunk_local(k[sl], v[sl], g[sl], beta[sl])
        starts.append(S.copy())
        Vn = loc["U"] - loc["W"] @ S
        kd = np.exp(loc["gam"][-1] - loc["gam"])
        S = np.exp(loc["gam"][-1]) * S + (kd[:, None] * k[sl]).T @ Vn
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    dg = np.zeros_like(g)
    dbeta = np.zeros_like(beta)
    dS = dht.copy()                                   # dL/dS' of the last chunk
    # pass 2 (reverse over chunks)
    for ci in reversed(range(len(starts))):
        c0 = ci * CHUNK
        sl = slice(c0, min(c0 + CHUNK, T))
        Q, Kc, Vc, dO, bc = q[sl], k[sl], v[sl], do[sl], beta[sl]
        S = starts[ci]
        loc = chunk_local(Kc, Vc, g[sl], bc)
        gam, Gam, KK, L, A = loc["gam"], loc["Gam"], loc["KK"], loc["L"], loc["A"]
        eg, Kb, Vb, W, U = loc["eg"], loc["Kb"], loc["Vb"], loc["W"], loc["U"]
        egC = np.exp(gam[-1])
        kd = np.exp(gam[-1] - gam)
        Vn = U - W @ S                                # fwd: Vn = U - W S
        P = np.tril(Q @ Kc.T) * Gam                   # fwd: P = lower_incl(Q K^T o Gamma)
        Kd = kd[:, None] * Kc
        Qg = eg[:, None] * Q
        dgam = np.zeros(Q.shape[0])
        # fwd: O = scale (Qg S + P Vn);  S' = e^gC S + Kd^T Vn
        dVn = scale * P.T @ dO + Kd @ dS
        dS_prev = egC * dS + scale * Qg.T @ dO - W.T @ dVn   # (+ the W S term of Vn)
        dP = np.tril(scale * dO @ Vn.T)
        dQg = scale * dO @ S.T
        dKd = Vn @ dS.T
        dgam[-1] += egC * np.sum(S * dS)              # fwd: e^gC S in S'
        # fwd: P_rs = (q_r.k_s) Gamma_rs, Gamma_rs = exp(gam_r - gam_s).
        # The diagonal (Gamma_rr = 1) has no gate dependence; it is dropped
        # so that its O(1) row and column terms do not cancel in rounding.
        E = np.tril(dP * P, -1)
        dgam += E.sum(1) - E.sum(0)
        M = dP * Gam
        dQ = M @ Kc
        dK = M.T @ Q
        # fwd: Qg = diag(e^gam) Q
        dQ += eg[:, None] * dQg
        dgam += (Qg * dQg).sum(1)
        # fwd: Kd = diag(e^(gC - gam)) K
        dK += kd[:, None] * dKd
        # e^(gC - gam_r) = exp(sum_{m > r} g_m): d g_m += sum_{r < m} t_r
        # (an exclusive prefix sum, added to dg after the reverse cumsum;
        # the equivalent dgam_r -= t_r, dgam_C += sum t cancels in rounding)
        t = (Kd * dKd).sum(1)
        dg_kd = np.concatenate(([0.0], np.cumsum(t)[:-1]))
        # fwd: Vn = U - W S
        dU = dVn
        dW = -dVn @ S.T
        # fwd: U = A Vb, W = A Kb
        dA = dU @ Vb.T + dW @ Kb.T
        dVb = A.T @ dU
        dKb = A.T @ dW
        # fwd: Vb = diag(b) V
        dV = bc[:, None] * dVb
        db = (Vc * dVb).sum(1)
        # fwd: Kb = diag(b e^gam) K
        dK += (bc * eg)[:, None] * dKb
        t2 = (Kc * dKb).sum(1) * eg
        db += t2
        dgam += bc * t2
        # fwd: A = (I + L)^-1  ->  dL = -A^T dA A^T (strict lower part)
        dL = np.tril(-A.T @ dA @ A.T, -1)
        # fwd: L_rs = b_r (k_r.k_s) Gamma_rs, r > s
        G = dL * Gam
        Bm = bc[:, None] * G
        dK += Bm @ Kc + Bm.T @ Kc
        db += (G * KK).sum(1)
        E2 = dL * L
        dgam += E2.sum(1) - E2.sum(0)
        # fwd: gam = cumsum(g) within the chunk
        dg[sl] = np.cumsum(dgam[::-1])[::-1] + dg_kd
        dq[sl], dk[sl], dv[sl], dbeta[sl] = dQ, dK, dV, db
        dS = dS_prev
    if use_l2:
        # fwd: q_hat = q / sqrt(|q|^2 + eps)
        nq = np.sqrt((q_in * q_in).sum(-1, keepdims=True) + EPS)
        nk = np.sqrt((k_in * k_in).sum(-1, keepdims=True) + EPS)
        dq = (dq - q * (q * dq).sum(-1, keepdims=True)) / nq
        dk = (dk - k * (k * dk).sum(-1, keepdims=True)) / nk
    return dq, dk, dv, dg, dbeta, dS


# ------------------------------------------------------------------ checks
def make_inputs(rng, T, K, V, A_h, use_l2):
    q = rng.standard_normal((T, K))
    k = rng.standard_normal((T, K))
    if not use_l2:  # realistic inputs are normalised already
        q, k = l2norm(q), l2norm(k)
    v = rng.standard_normal((T, V))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(T)))
    g = -A_h * np.log1p(np.exp(0.5 * rng.standard_normal(T) + 1.0))
    h0 = rng.standard_normal((K, V))
    do = rng.standard_normal((T, V))
    dht = rng.standard_normal((K, V))
    return q, k, v, g, beta, h0, do, dht


def rel(a, b):
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (nb if nb > 0 else 1.0)


def check_forward(rng):
    worst = 0.0
    for T in (1, 63, 64, 65, 200):
        for A_h in (0.0, 1.0, 16.0):
            for use_l2 in (False, True):
                q, k, v, g, beta, h0, _, _ = make_inputs(rng, T, 32, 24, A_h, use_l2)
                o1, s1 = recurrent_fwd(q, k, v, g, beta, 0.3, h0, use_l2)
                o2, s2 = chunk_fwd(q, k, v, g, beta, 0.3, h0, use_l2)
                worst = max(worst, rel(o2, o1), rel(s2, s1))
    print(f"(a) chunk forward vs recurrence: worst rel {worst:.2e} (tolerance {TOL_F64:.0e})")
    return worst <= TOL_F64


def check_fd(rng):
    """Directional derivatives: <grad, dir> vs (L(x+h dir) - L(x-h dir)) / 2h."""
    worst = 0.0
    h = 1e-6
    names = ["q", "k", "v", "g", "beta", "h0"]
    for T, A_h, use_l2 in ((70, 1.0, False), (130, 4.0, True), (65, 0.0, True)):
        K, V = 16, 12
        q, k, v, g, beta, h0, do, dht = make_inputs(rng, T, K, V, A_h, use_l2)
        scale = K ** -0.5
        grads = chunk_bwd(q, k, v, g, beta, scale, h0, do, dht, use_l2)
        gmap = dict(zip(names, (grads[0], grads[1], grads[2], grads[3], grads[4], grads[5])))
        base = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)

        def loss(x):
            o, S = recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], use_l2)
            return (o * do).sum() + (S * dht).sum()

        for name in names:
            d = rng.standard_normal(base[name].shape)
            xp = dict(base)
            xm = dict(base)
            xp[name] = base[name] + h * d
            xm[name] = base[name] - h * d
            fd = (loss(xp) - loss(xm)) / (2 * h)
            an = (gmap[name] * d).sum()
            r = abs(fd - an) / max(abs(fd), 1e-12)
            worst = max(worst, r)
    print(f"(b) chunk backward vs central finite differences: worst rel {worst:.2e} "
          f"(tolerance {FD_TOL:.0e})")
    return worst <= FD_TOL


def check_reverse_mode(rng):
    worst = {}
    for T in (1, 63, 64, 65, 200):
        for A_h in (0.0, 1.0, 16.0):
            for use_l2 in (False, True):
                for K, V in ((32, 24), (16, 40)):
                    q, k, v, g, beta, h0, do, dht = make_inputs(rng, T, K, V, A_h, use_l2)
                    scale = K ** -0.5
                    ours = chunk_bwd(q, k, v, g, beta, scale, h0, do, dht, use_l2)
                    ref = recurrent_bwd(q, k, v, g, beta, scale, h0, do, dht, use_l2)
                    for name, a, r in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], ours, ref):
                        worst[name] = max(worst.get(name, 0.0), rel(a, r))
    print("(c) chunk backward vs the reference's reverse mode: worst rel "
          + ", ".join(f"{n} {w:.1e}" for n, w in worst.items()) + f" (tolerance {TOL_F64:.0e})")
    return max(worst.values()) <= TOL_F64


def main():
    rng = np.random.default_rng(0)
    ok = check_forward(rng)
    ok = check_fd(rng) and ok
    ok = check_reverse_mode(rng) and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
