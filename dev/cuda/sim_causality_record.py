"""
sim_causality_record.py -- float64 simulation of the causality handling (issue 9)
of a backward without stage A v3 (benchmarks/NOTES.md, session 16, "Stage A v3
out of the backward"): each chunk of the reverse walk reads only what the fused
forward's stage A (fq_fwd_inverse_kernel, gdn_cuda_fwd_wy.cu) stores -- its gate
record (FQ_REC_*) and A = (I + L)^-1 -- plus the chunk-start states h of the
recompute's HST pass (the fused chain, simulated with the record's semantics),
the input tiles and dO. Checked against the NaN pattern of the token-by-token
reference (flashqla/reference.py, loaded by path: no build needed).

    /tmp/simvenv/bin/python dev/cuda/sim_causality_record.py [--no-ablations]

Dense products (mm) multiply 0 * NaN like the tensor cores; row and column sums
are explicit sums of a tile's entries; a "select" is a select (never a product
with a 0/1 mask). Tiles are 64 rows: rows past the sequence (another sequence's
in a packed batch) hold NaN here, the worst case.

Fused stage A (per chunk and value head; NEW: changed against today's kernel):
  g'    = clamp(g) (-inf -> -100, NaN passes), NEW then isfinite(g') ? g' : 0;
          tg = the chunk's first row with a non-finite g (64: none);
  gamma = cumsum(g');  X_rc = beta_r rk_r rk_c e^{gamma_r - gamma_c} (k_r . k_c)
          (K rows, g, beta, rk, rq zero past len);
  fl    = the first row with a non-finite X_rc, c <= r;  NEW f = min(fl, tg)
          (today f = fl: fl sees a NaN g through gamma, a finite gamma hides it);
  L     = select(c < r and X finite, X, 0);  A = (I + L)^-1 (finite);
  A''   = select(c < f, A beta_c, 0) (unchanged; the forward's);
  NEW   A stored too: the shared tile before the beta scaling (no beta, every
          column kept; packed like A'': its upper blocks are exact zeros);
  record: G2 = gamma log2 e (NEW: finite on every row, from g'), RK, PRQ, FA1,
          QG, KD, EC = f < 64 ? NaN : e^{gamma_C}, F = f as today; NEW BETA_r =
          isfinite(beta_r) ? beta_r : 0 on every row (today 0 from row f on;
          the forward never reads BETA).
Fused chain (forward FULL and the HST pass; unchanged): fv = the first row
< len with a non-finite v; a private copy of the record gets QG = NaN from fv
on and EC = NaN; rows >= zr = min(len, f, fv) of the Q, K, V tiles zeroed;
X = K S, Y = V - diag(FA1) X, Vn = A'' Y, P = select(c <= r, (Q K^T) PRQ_r
RK_c 2^{G2_r - G2_c}, 0), O = diag(QG) Q S + P Vn, S' = EC S + K^T diag(KD) Vn.
The backward's chunk (A form; derive_bwd_fused_check.py's walk), reading of the
record only G2, RK, PRQ, BETA, EC (not F, FA1, QG, KD):
  tiles: rows >= len of Q, K, V, dO zeroed (as the forward's checker does);
         K's and V's non-finite elements zeroed (selects at the load); dO raw
         everywhere but in P^T dO, which takes dOz = dO with its non-finite
         elements zeroed;
  rows:  rk' = isfinite(RK) ? RK : 0 (q, k enter as rq Q, rk' K), beta = BETA,
         gamma = G2 ln 2, and e^gamma, kd = e^{gamma_C - gamma}, qg = PRQ e^gamma
         formed from them; Gamma and every lower / strict lower tile (P,
         dP . Gamma, dP . P, K K^T . Gamma, dL) by selects;
  Vn    = A diag(beta) (V - diag(e^gamma) K h), recomputed on chip;
  dVn   = P^T dOz + diag(kd) K dS';  dv = diag(beta) A^T dVn;
  dS    = EC dS' + Q^T diag(qg) dO - K^T diag(e^gamma beta) A^T dVn: EC, the
          record's (NaN when f < 64), is the only NaN injected: it makes dh0 NaN
          wherever the reference's is; dgamma_C += EC <h, dS'>;
  dg    = a pure suffix sum of dgamma in the chunk.
The check (per case one line): wherever the reference gradient (dq, dk, dv, dg,
dbeta, dh0) is finite the simulated one is finite and equal (1e-9 relative),
every token; H = 1, HV = 2 (GVA: dq, dk summed over the group); a NaN in v, k
(the q/k head: both value heads), beta, g, do (value head 0; g also at a
chunk's first and last row, in the short last chunk, in chunk 0, twice in one
chunk, in two chunks), none, and k, g, none with use_qk_l2norm; dh0 NaN
wherever the reference's is; for k, beta, g the HST pass's state after the NaN
token's chunk NaN everywhere; the forward on the NEW record: o before the token
exact and bit-equal to today's record's, o from it on and the final state NaN
(the value heads with the NaN). Then, unless --no-ablations: each rule or NEW
item off in turn and the cases it breaks (every one is needed), and
alternatives that pass too or not (the record's QG; W = A'' diag(FA1) K in the
dS chain; the HST pass's stored Vn: pass; the record's KD: fails).
Exit status 1 when a case fails.
"""
import importlib.util
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim_causality_bwd import check  # noqa: E402  (the same check: finite and exact where the reference is)

_spec = importlib.util.spec_from_file_location(  # flashqla/reference.py alone (no built extension needed)
    "fq_reference", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashqla", "reference.py"))
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

NAN = float("nan")
# the rules and NEW items; an ablation turns one off
RULES = {
    "g2_prime": "record G2 from g' = isfinite(g) ? g : 0 and f = min(fl, tg) (else: today's cumsum of the "
                "clamped g, NaN from tg on, G2's non-finite entries zeroed by the backward)",
    "beta_all": "record BETA = isfinite(beta) ? beta : 0 on every row (else: today's 0 from row f on)",
    "a_full": "A stored with every column (else: A's columns >= f cut, all that A'' keeps)",
    "k_sel": "the backward zeroes K's non-finite elements",
    "v_sel": "the backward zeroes V's non-finite elements",
    "do_sel": "P^T dO from dO with its non-finite elements zeroed",
    "rk_sel": "rk' = isfinite(RK) ? RK : 0",
    "pad_zero": "the backward zeroes rows >= len of its Q, K, V, dO tiles (another sequence's rows)",
    "ec_nan": "EC (NaN when f < 64) in dS = EC dS' + ... (else e^{gamma_C}: no NaN injected)",
}


# alternatives (off by default), tried one at a time on top of the rules
ALTS = {
    "alt_qg_rec": "the record's QG (NaN from row f on) for dQ's diag(qg) dO h^T, dS's Q^T diag(qg) dO and dgamma",
    "alt_kd_rec": "the record's KD (0 from row f on) in dVn's diag(kd) K dS'",
    "alt_w_rec": "W = A'' diag(FA1) K (K raw: session 16's plan for bwd_state) in dS's W^T dVn",
    "alt_vn_hst": "the HST pass's Vn (its tiles cut from zr on) instead of Vn recomputed on chip",
}


def fin0(x):
    return np.where(np.isfinite(x), x, 0.0)


def mm(a, b):
    """a @ b as a tensor core forms it: every product summed, 0 * NaN = NaN (no BLAS shortcut)."""
    return (a[:, :, None] * b[None, :, :]).sum(1)


def first(mask):
    idx = np.flatnonzero(mask)
    return int(idx[0]) if len(idx) else 64


def stage_a(kr, rk, rq, g, beta, scale, on):
    """Fused stage A of one item (chunk, value head): (A stored, A'', record)."""
    n = len(g)
    r, c = np.indices((n, n))
    gc = np.where(g < -100.0, -100.0, g)                   # fq_gate_clamp: NaN passes
    tg = first(~np.isfinite(gc))
    if on["g2_prime"]:
        gc = np.where(np.isfinite(gc), gc, 0.0)
    gam = np.cumsum(gc)
    X = (beta * rk)[:, None] * mm(kr, kr.T) * rk[None, :] * np.exp(gam[:, None] - gam[None, :])
    fl = first(((c <= r) & ~np.isfinite(X)).any(1))
    f = min(fl, tg) if on["g2_prime"] else fl
    L = np.where((c < r) & np.isfinite(X), X, 0.0)
    A = np.linalg.inv(np.eye(n) + L)
    App = np.where(c < f, A * beta[None, :], 0.0)
    ok = np.arange(n) < f
    eg = np.exp(gam)
    rec = dict(G=gam, RK=rk, PRQ=scale * rq, FA1=np.where(ok, eg * rk, 0.0), QG=np.where(ok, scale * eg * rq, NAN),
               KD=np.where(ok, np.exp(gam[-1] - gam) * rk, 0.0),
               BETA=fin0(beta) if on["beta_all"] else np.where(ok, beta, 0.0),
               EC=NAN if f < 64 else np.exp(gam[-1]), F=f)
    Ast = A if on["a_full"] else np.where(c < f, A, 0.0)
    return Ast, App, rec


def fused_chain(qr, kr, vj, items, h0, chunks):
    """The fused forward's chain for one value head (FULL and the backward's HST pass): o, the
    chunk-start states h (and the state after the last chunk)."""
    o = np.zeros_like(vj)
    S, hs, vns = h0.copy(), [], []
    r, c = np.indices((64, 64))
    for ci, (t0, n) in enumerate(chunks):
        _, App, rec = items[ci]
        t1 = t0 + 64
        Vc = vj[t0:t1]
        fv = first((~np.isfinite(Vc[:n])).any(1))          # (rows >= len, another sequence's: not looked at)
        qg, ec = rec["QG"].copy(), rec["EC"]
        if fv < 64:                                        # the checker's private copy of the record
            qg[fv:] = NAN
            ec = NAN
        zr = min(n, rec["F"], fv)
        cut = (np.arange(64) >= zr)[:, None]
        Qz, Kz, Vz = (np.where(cut, 0.0, x) for x in (qr[t0:t1], kr[t0:t1], Vc))
        hs.append(S.copy())
        Xs = mm(Kz, S)
        Y = Vz - rec["FA1"][:, None] * Xs
        Vn = mm(App, Y)
        vns.append(Vn)
        G = rec["G"]
        P = np.where(c <= r, mm(Qz, Kz.T) * rec["PRQ"][:, None] * rec["RK"][None, :] * np.exp(G[:, None] - G[None, :]),
                     0.0)
        o[t0:t1] = qg[:, None] * mm(Qz, S) + mm(P, Vn)
        S = ec * S + mm(Kz.T, rec["KD"][:, None] * Vn)
    hs.append(S.copy())
    return o, hs, vns


def backward_head(qr, kr, vj, doj, items, hs, vns, dht, scale, chunks, on):
    """One value head's reverse walk (A form) from the stored A, the record and h:
    dq, dk w.r.t. the normalised q, k (before the GVA sum), dv, dg, dbeta, dh0."""
    T = len(qr)
    dq, dk, dv = np.zeros_like(qr), np.zeros_like(kr), np.zeros_like(vj)
    dg, dbeta = np.zeros(T), np.zeros(T)
    dSn = dht.copy()
    r, c = np.indices((64, 64))
    low, slow = c <= r, c < r
    for ci in reversed(range(len(chunks))):
        t0, n = chunks[ci]
        t1 = t0 + 64
        A, App, rec = items[ci]
        h = hs[ci]
        # the tiles: rows >= len (another sequence's) zeroed, as the forward's checker does
        pad = (np.arange(64) >= n)[:, None] if on["pad_zero"] else np.zeros((64, 1), bool)
        Qt, Kt, Vt, dO = (np.where(pad, 0.0, x[t0:t1]) for x in (qr, kr, vj, doj))
        rk = fin0(rec["RK"]) if on["rk_sel"] else rec["RK"]
        rq = rec["PRQ"] / scale
        Kraw, Kt = Kt, (fin0(Kt) if on["k_sel"] else Kt)
        Vz = fin0(Vt) if on["v_sel"] else Vt
        dOz = fin0(dO) if on["do_sel"] else dO
        Qh, Kh = Qt * rq[:, None], Kt * rk[:, None]
        b, G = rec["BETA"], rec["G"]
        if not on["g2_prime"]:   # today's G2 (NaN from tg on): the best a select can do, no g to recover from
            G = fin0(G)
        EC = rec["EC"] if on["ec_nan"] else np.exp(G[-1])
        eg, kd = np.exp(G), np.exp(G[-1] - G)
        Gm = np.where(low, np.exp(G[:, None] - G[None, :]), 0.0)
        # forward lines, recomputed on chip
        X = mm(Kh, h)
        Y0 = Vz - eg[:, None] * X
        Y = b[:, None] * Y0
        Vn = vns[ci] if on["alt_vn_hst"] else mm(A, Y)
        egq = np.where(rq != 0, rec["QG"] / (scale * np.where(rq != 0, rq, 1)), 0) if on["alt_qg_rec"] else eg
        P = np.where(low, scale * mm(Qh, Kh.T) * Gm, 0.0)
        # O = scale diag(e^g) Q h + P Vn
        dVn = mm(P.T, dOz)
        dP = mm(dO, Vn.T)
        dQ = scale * egq[:, None] * mm(dO, h.T)
        dS = scale * mm((egq[:, None] * Qh).T, dO)
        dgam = scale * egq * (mm(Qh, h) * dO).sum(1)
        Z = np.where(low, dP * P, 0.0)
        dgam = dgam + Z.sum(1) - Z.sum(0)
        dPG = np.where(low, scale * dP * Gm, 0.0)
        dQ = dQ + mm(dPG, Kh)
        dK = mm(dPG.T, Qh)
        # S' = e^{gC} h + K^T diag(kd) Vn
        dS = dS + EC * dSn
        KdS = mm(Kh, dSn)
        dVn = dVn + (rec["KD"][:, None] * mm(Kt, dSn) if on["alt_kd_rec"] else kd[:, None] * KdS)
        dK = dK + kd[:, None] * mm(Vn, dSn.T)
        xs = kd * (KdS * Vn).sum(1)
        dgam = dgam - xs
        dgam[-1] += xs.sum() + EC * (h * dSn).sum()
        # Vn = A Y, Y = diag(beta) (V - diag(e^g) K h)
        dA = mm(dVn, Y.T)
        dYb = mm(A.T, dVn)
        db = (dYb * Y0).sum(1)
        dY = b[:, None] * dYb
        edY = eg[:, None] * dY
        dS = dS - (mm(mm(App * rec["FA1"][None, :], Kraw).T, dVn) if on["alt_w_rec"] else mm(Kh.T, edY))
        dK = dK - mm(edY, h.T)
        dgam = dgam - eg * (X * dY).sum(1)
        # A = (I + L)^-1, L = strict_lower(diag(beta) (K K^T . Gamma))
        KKG = np.where(slow, mm(Kh, Kh.T) * Gm, 0.0)
        dL = -np.where(slow, mm(mm(A.T, dA), A.T), 0.0)
        Hm = b[:, None] * np.where(slow, dL * Gm, 0.0)
        Z2 = np.where(slow, dL * b[:, None] * KKG, 0.0)
        db = db + np.where(slow, dL * KKG, 0.0).sum(1)
        dK = dK + mm(Hm, Kh) + mm(Hm.T, Kh)
        dgam = dgam + Z2.sum(1) - Z2.sum(0)
        dg[t0:t1] = np.cumsum(dgam[::-1])[::-1]           # a pure suffix sum (padding rows: zero terms)
        dbeta[t0:t1], dv[t0:t1], dq[t0:t1], dk[t0:t1] = db, dY, dQ, dK  # (rows >= len: not stored, cut below)
        dSn = dS
    return dq, dk, dv, dg, dbeta, dSn


def l2n_backward(x, dx):
    r = 1.0 / np.sqrt((x * x).sum(-1, keepdims=True) + reference.L2NORM_EPS)
    xh = x * r
    return r * (dx - xh * (xh * dx).sum(-1, keepdims=True))


def run(q, k, v, g, beta, h0, do, dht, scale, l2, on, C=64):
    """q, k [T, K] (one q/k head), v, do [T, HV, V], g, beta [T, HV], h0, dht [HV, K, V]."""
    T, HV = g.shape
    nc = (T + C - 1) // C
    chunks = [(64 * i, min(64, T - 64 * i)) for i in range(nc)]      # (first row, len)
    if l2:
        rq = 1.0 / np.sqrt((q * q).sum(1) + reference.L2NORM_EPS)
        rk = 1.0 / np.sqrt((k * k).sum(1) + reference.L2NORM_EPS)
    else:
        rq, rk = np.ones(T), np.ones(T)
    # the tiles are 64 rows; rows past the sequence are another sequence's: NaN here (the worst case)
    padn = lambda x: np.concatenate([x, np.full((64 * nc - T,) + x.shape[1:], NAN)])
    qp, kp, vp, dop = padn(q), padn(k), padn(v), padn(do)
    # stage A loads zeros there (K rows, g, beta, rk, rq)
    pad0 = lambda x: np.concatenate([x, np.zeros((64 * nc - T,) + x.shape[1:])])
    ks, rks, rqs, gs, bs = pad0(k), pad0(rk), pad0(rq), pad0(g), pad0(beta)
    o, ht, hst = np.zeros_like(vp), np.zeros_like(h0), []
    grads = [np.zeros_like(qp), np.zeros_like(kp), np.zeros_like(vp), np.zeros(gs.shape), np.zeros(bs.shape),
             np.zeros_like(h0)]
    for j in range(HV):
        items = [stage_a(ks[t0:t0 + 64], rks[t0:t0 + 64], rqs[t0:t0 + 64], gs[t0:t0 + 64, j], bs[t0:t0 + 64, j], scale,
                         on) for t0, _ in chunks]
        oj, hs, vns = fused_chain(qp, kp, vp[:, j], items, h0[j], chunks)
        o[:, j], ht[j] = oj, hs[-1]
        hst.append(hs)
        dq, dk, dv, dg, db, dh0 = backward_head(qp, kp, vp[:, j], dop[:, j], items, hs, vns, dht[j], scale, chunks, on)
        grads[0] += dq                                        # the GVA sum (normalised q, k)
        grads[1] += dk
        grads[2][:, j], grads[3][:, j], grads[4][:, j], grads[5][j] = dv, dg, db, dh0
    grads = [x[:T] for x in grads[:5]] + [grads[5]]
    if l2:
        grads[0], grads[1] = l2n_backward(q, grads[0]), l2n_backward(k, grads[1])
    return o[:T], ht, hst, grads


CASES = [("v", [100], 0), ("k", [100], 0), ("beta", [100], 0), ("g", [100], 0), ("g", [128], 0), ("g", [127], 0),
         ("g", [140], 0), ("g", [5], 0), ("g", [100, 110], 0), ("g", [70, 130], 0), ("do", [100], 0), ("none", [], 0),
         ("k", [100], 1), ("g", [100], 1), ("none", [], 1)]
GN = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def inputs(field, toks, l2, seed):
    rng = np.random.default_rng(seed)
    T, K, V, HV = 150, 16, 16, 2                 # chunks 0..127 (two) and 128..149 (short)
    q = rng.standard_normal((T, K)); k = rng.standard_normal((T, K))
    if not l2:
        q /= np.linalg.norm(q, axis=1, keepdims=True); k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((T, HV, V))
    g = -np.log1p(np.exp(0.5 * rng.standard_normal((T, HV)) + 1)) * 0.5
    beta = 1 / (1 + np.exp(-rng.standard_normal((T, HV))))
    h0 = 0.5 * rng.standard_normal((HV, K, V)); do = rng.standard_normal((T, HV, V))
    dht = 0.5 * rng.standard_normal((HV, K, V))
    for t in toks:                               # value head 0 (k: the q/k head, both value heads)
        if field == "k":
            k[t, 1] = NAN
        elif field in ("v", "do"):
            {"v": v, "do": do}[field][t, 0, 1] = NAN
        elif field in ("beta", "g"):
            {"beta": beta, "g": g}[field][t, 0] = NAN
    return q, k, v, g, beta, h0, do, dht


def one_case(field, toks, l2, on, seed, want_fwd):
    q, k, v, g, beta, h0, do, dht = inputs(field, toks, l2, seed)
    K = q.shape[1]
    scale = K ** -0.5
    with np.errstate(all="ignore"):
        args = (q[None, :, None], k[None, :, None], v[None], g[None], beta[None])
        ro, rht = reference.forward(*args, scale=scale, initial_state=h0[None], use_qk_l2norm=bool(l2))
        rg = reference.backward(*args, do[None], dfinal_state=dht[None], scale=scale, initial_state=h0[None],
                                use_qk_l2norm=bool(l2))
        o, ht, hst, got = run(q, k, v, g, beta, h0, do, dht, scale, l2, on)
    refs = [rg[0][0, :, 0], rg[1][0, :, 0], rg[2][0], rg[3][0], rg[4][0], rg[5][0]]
    msgs = [check(n, x, r) for n, x, r in zip(GN, got, refs)]
    leak = np.isnan(refs[5]) & np.isfinite(got[5])
    if leak.any():
        msgs.append(f"dh0: {int(leak.sum())} finite where the reference is NaN")
    t = toks[0] if toks else None
    if field in ("k", "beta", "g"):
        heads = (0, 1) if field == "k" else (0,)
        if any(np.isfinite(hst[j][t // 64 + 1]).any() for j in heads):
            msgs.append("the HST pass's state after the NaN token's chunk has finite entries")
    if want_fwd:
        hit = (0, 1) if field == "k" else (0,) if field in ("v", "beta", "g") else ()
        with np.errstate(all="ignore"):
            o_today = run(q, k, v, g, beta, h0, do, dht, scale, l2, dict(on, g2_prime=False))[0]
        for j in range(2):
            tj = t if j in hit else len(q)
            msgs.append(check(f"o[head {j}]", o[:tj, j], ro[0, :tj, j]))
            if not np.array_equal(o[:tj, j], o_today[:tj, j]):
                msgs.append(f"o[head {j}] before the token differs from today's record's")
            if j in hit:
                if not np.isnan(o[tj:, j]).any(1).all():
                    msgs.append(f"o[head {j}]: a finite row from the NaN token on")
                if not np.isnan(ht[j]).any():
                    msgs.append(f"ht[head {j}]: finite")
    msgs = [m for m in msgs if m]
    nfin = {n: int(np.isfinite(r).sum()) for n, r in zip(GN, refs)}
    return msgs, nfin


def main():
    warnings.simplefilter("ignore")
    on = dict({name: True for name in RULES}, **{name: False for name in ALTS})
    fails = 0
    for field, toks, l2 in CASES:
        msgs, nfin = one_case(field, toks, l2, on, 0, True)
        tag = f"{field}{'+l2norm' if l2 else ''}"
        print(f"NaN in {tag:11s} at {str(toks):10s}: reference finite {nfin}: " + ("OK" if not msgs else "; ".join(msgs)))
        fails += bool(msgs)
    if "--no-ablations" not in sys.argv:
        def broken(opts):
            """the cases that fail with these switches, and which gradients"""
            out = []
            for field, toks, l2 in CASES:
                msgs, _ = one_case(field, toks, l2, opts, 0, False)
                if msgs:
                    names = sorted({m.split(":")[0] for m in msgs})
                    out.append(f"{field}{'+l2' if l2 else ''}{toks if len(toks) != 1 or field == 'g' else ''}"
                               + f" ({', '.join(names)})")
            return out
        print("ablations (each rule / NEW item off in turn; the cases that then fail, and which gradients):")
        for name, what in RULES.items():
            broke = broken(dict(on, **{name: False}))
            print(f"  without {name}: {what}:\n    " + ("; ".join(broke) if broke else "passes: not needed"))
        print("alternatives (one at a time, on top of the rules):")
        for name, what in ALTS.items():
            broke = broken(dict(on, **{name: True}))
            print(f"  {name}: {what}:\n    " + ("fails: " + "; ".join(broke) if broke else "passes too"))
    if fails:
        print("FAIL")
        sys.exit(1)
    print("OK: from the record (G2 from g', BETA on every row), the stored A and the HST states, the backward is "
          "finite and exact wherever the reference is, and dh0 NaN wherever the reference's is")


if __name__ == "__main__":
    main()
