"""Numerics of the fused sm_90a forward (gdn_cuda_fwd_fused.cu), simulated in NumPy.

Rounds to bf16 exactly where the kernel rounds (tensor-core operands, stored
tiles), accumulates in float32, and compares o and the final state with the
float64 token-by-token reference (flashqla.reference) on model-like inputs
(DESIGN §3). Used to choose the precision of each intermediate before writing
the kernel; run: python dev/cuda/sim_fwd_fused_numerics.py
"""
import sys
import numpy as np

sys.path.insert(0, "tests")
from gdn_testing import make_inputs, rel_error  # noqa: E402
from flashqla import reference  # noqa: E402


def bf16(x):
    """Round float32 to the nearest bf16 (ties to even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def chunk_forward(q, k, v, g, beta, h0, scale, opt):
    """One sequence, one head: q, k [T, K], v [T, V] (bf16 values), g, beta [T]."""
    T, K = q.shape
    V = v.shape[1]
    S = f32(h0).copy()
    o = np.zeros((T, V), np.float32)
    for c0 in range(0, T, 64):
        Q, Kc, Vc = q[c0:c0 + 64], k[c0:c0 + 64], v[c0:c0 + 64]
        gc, bc = f32(g[c0:c0 + 64]), f32(beta[c0:c0 + 64])
        n = len(gc)
        gam = np.cumsum(gc, dtype=np.float32)
        G = f32(Kc) @ f32(Kc).T                      # bf16 x bf16 -> fp32
        Gam = np.exp(gam[:, None] - gam[None, :])
        low = np.tril(np.ones((n, n), bool), -1)
        L = np.where(low, bc[:, None] * G * Gam, 0).astype(np.float32)
        if opt["inv"] == "fp32":
            A = np.linalg.inv(np.eye(n) + L.astype(np.float64)).astype(np.float32)
        else:  # blocked, bf16 operands in the off-diagonal products (diag blocks fp32)
            A = inv_blocked_bf16(L)
        fw = bc * np.exp(gam)                        # columns of A for W
        if opt["a_store"] == "bf16":                 # A stored once in bf16, scaled after
            Ab = bf16(A)
            A1, A2 = bf16(Ab * fw[None, :]), bf16(Ab * bc[None, :])
        else:
            A1, A2 = bf16(A * fw[None, :]), bf16(A * bc[None, :])
        W = bf16(A1 @ f32(Kc))
        U = A2 @ f32(Vc)
        if opt["u"] == "bf16":
            U = bf16(U)
        P = np.where(np.tril(np.ones((n, n), bool)), (f32(Q) @ f32(Kc).T) * Gam * scale, 0)
        P = bf16(P)
        Qg = bf16(Q * (scale * np.exp(gam))[:, None])
        Kd = bf16(Kc * np.exp(gam[-1] - gam)[:, None])
        Sb = bf16(S)
        if opt.get("x") in ("cross", "cross2") and c0 > 0:
            # X = K S from the previous chunk's pieces (off the chain's critical path):
            # e^{gamma_C'} K bf16(S') + bf16(K K'^T) bf16(diag(kd') Vn'), G split in two parts for cross2
            Gx = f32(Kc) @ f32(prev["K"]).T
            Gh = bf16(Gx)
            X = prev["eC"] * (f32(Kc) @ prev["Sb"]) + Gh @ prev["Vnd"]
            if opt["x"] == "cross2":
                X = X + bf16(Gx - Gh) @ prev["Vnd"]
        else:
            X = f32(Kc) @ Sb
        if opt.get("vn") in ("ay", "ay2"):  # Vn = A'' (V - diag(e^gamma) K S): no W, no U
            Y = f32(Vc) - np.exp(gam)[:, None] * X
            Yh = bf16(Y)
            Vn = A2 @ Yh
            if opt["vn"] == "ay2":            # Y split into two bf16 parts
                Vn = Vn + A2 @ bf16(Y - Yh)
        elif opt.get("vn") == "aby2":  # Vn = A (diag(beta) Y): A stored (bf16), beta on Y's rows
            Y = bc[:, None] * (f32(Vc) - np.exp(gam)[:, None] * X)
            Yh = bf16(Y)
            Ab = bf16(A)
            Vn = Ab @ Yh + Ab @ bf16(Y - Yh)
        else:
            Vn = U - W @ Sb
        Vnb = bf16(Vn)
        o[c0:c0 + 64] = bf16(Qg @ Sb + P @ Vnb)
        if opt.get("x") in ("cross", "cross2"):   # the kernel's update: raw K, diag(kd) on Vn
            kd = np.exp(gam[-1] - gam)
            Vnd = bf16(kd[:, None] * Vn)
            prev = {"K": Kc, "Sb": Sb, "eC": np.float32(np.exp(gam[-1])), "Vnd": Vnd}
            S = np.exp(gam[-1]) * S + f32(Kc).T @ Vnd
            continue
        S = np.exp(gam[-1]) * S + Kd.T @ Vnb
    return o, S


def inv_blocked_bf16(L):
    n = L.shape[0]
    nb = (n + 15) // 16
    A = np.zeros_like(L)
    for i in range(nb):
        sl = slice(16 * i, min(16 * i + 16, n))
        m = sl.stop - sl.start
        A[sl, sl] = np.linalg.inv(np.eye(m) + L[sl, sl].astype(np.float64)).astype(np.float32)
    for i in range(nb):
        si = slice(16 * i, min(16 * i + 16, n))
        for j in range(i - 1, -1, -1):
            sj = slice(16 * j, 16 * j + 16)
            T = np.zeros((si.stop - si.start, 16), np.float32)
            for kk in range(j, i):
                sk = slice(16 * kk, 16 * kk + 16)
                T += bf16(L[si, sk]) @ bf16(A[sk, sj])
            A[si, sj] = -(bf16(A[si, si]) @ bf16(T))
    return A


def run(opt, T=4096, HV=4, seed=1):
    inp = make_inputs(1, T, 1, HV, 128, 128, seed=seed)
    q, k, v = (bf16(inp[n]).astype(np.float64) for n in ("q", "k", "v"))
    g, beta, h0 = inp["g"].astype(np.float32), inp["beta"].astype(np.float32), inp["h0"].astype(np.float32)
    scale = 128 ** -0.5
    o_ref, ht_ref = reference.forward(q, k, v, g.astype(np.float64), beta.astype(np.float64),
                                      scale=scale, initial_state=h0.astype(np.float64))
    o = np.zeros_like(o_ref)
    ht = np.zeros_like(ht_ref)
    for j in range(HV):
        oj, sj = chunk_forward(f32(q[0, :, 0]), f32(k[0, :, 0]), f32(v[0, :, j]), g[0, :, j], beta[0, :, j],
                               h0[0, j], scale, opt)
        o[0, :, j], ht[0, j] = oj, sj
    return rel_error(o, o_ref), rel_error(ht, ht_ref)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "beta":
        # A stored (for the fused backward's L backward, which needs A, not A diag(beta)) and
        # beta applied to Y's rows before the bf16 split (NOTES, session 10) vs today's A''
        for T, seed in ((2048, 1), (2048, 2), (4096, 3)):
            for vn in ("ay2", "aby2"):
                eo, eh = run({"inv": "bf16", "a_store": "bf16", "u": "fp32", "vn": vn}, T=T, seed=seed)
                print(f"T {T} seed {seed} vn {vn:5s} o {eo:.2e}  ht {eh:.2e}")
        sys.exit()
    if len(sys.argv) > 1 and sys.argv[1] == "cross":
        # the cross-chunk form of X (NOTES, session 8) against today's kernel (vn ay2, x direct)
        for T, seed in ((2048, 1), (2048, 2), (4096, 3)):
            for x in ("direct", "cross", "cross2"):
                eo, eh = run({"inv": "bf16", "a_store": "bf16", "u": "fp32", "vn": "ay2", "x": x}, T=T, seed=seed)
                print(f"T {T} seed {seed} x {x:7s} o {eo:.2e}  ht {eh:.2e}")
        sys.exit()
    for opt in ({"inv": "fp32", "a_store": "fp32", "u": "fp32"},
                {"inv": "fp32", "a_store": "fp32", "u": "bf16"},
                {"inv": "fp32", "a_store": "bf16", "u": "fp32"},
                {"inv": "fp32", "a_store": "bf16", "u": "bf16"},
                {"inv": "bf16", "a_store": "fp32", "u": "fp32"}):
        eo, eh = run(opt)
        print(opt, f"o {eo:.2e}  ht {eh:.2e}")
