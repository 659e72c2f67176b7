"""flashqla.reference — the float64 NumPy reference of the gated delta rule.

This is the plain token-by-token recurrence of DESIGN.md §1 and its
hand-written reverse mode (backpropagation through time). It shares no code
with the chunked algorithm (DESIGN §2) that the C and CUDA backends run, so
the tests can compare the two. Slow on purpose: a Python loop over tokens,
vectorised over value heads only. Everything is computed in float64.

Per sequence and value head j (q/k head h = j // (HV/H)), tokens t = 1..T:

    a_t  = exp(g_t)
    Sd_t = a_t S_{t-1}                   the decayed state
    p_t  = Sd_tᵀ k_t                     what the state predicts for k_t
    u_t  = β_t (v_t − p_t)
    S_t  = Sd_t + k_t u_tᵀ
    o_t  = scale · S_tᵀ q_t

With use_qk_l2norm, q and k are first replaced by x / sqrt(Σ x² + 1e-6) per
head vector (the form FLA uses), gradients included.

Layouts as in csrc/gdn.h: q, k [B,T,H,K]; v [B,T,HV,V]; g, beta [B,T,HV];
states [N,HV,K,V]; cu_seqlens [N+1] (B == 1 then).

This module also holds the project's one tolerance table (TOLERANCES,
tolerance()): the tests, benchmarks/bench_gpu.py, the demo and the dev
checkers all take their limits from it (the C checkers in dev/cpu through a
header the dev Makefile generates: python3 flashqla/reference.py --c-header).
It imports nothing but NumPy, so scripts may load it by path without a built
flashqla.
"""

import numpy as np

L2NORM_EPS = 1e-6
CHECKPOINT_EVERY = 64  # the backward stores every 64th state and recomputes between

__all__ = ["forward", "backward", "recurrent", "states", "gates", "gates_backward", "l2norm",
           "L2NORM_EPS", "TOLERANCES",
           "tolerance", "rel_error"]

# ---- the tolerance table (DESIGN §3) ----------------------------------------
# rel = ||out - ref||_2 / ||ref||_2 against this reference; NaN or Inf never
# passes. By the dtype of the inputs (q, k, v) and what is compared:
#   "out"   o and the final state (or the updated pool)
#   "grad"  dq, dk, dv, dbeta, dh0
#   "dg"    dg (a reverse cumulative sum: the loosest)
TOLERANCES = {
    "bfloat16": {"out": 5e-3, "grad": 1e-2, "dg": 2e-2},
    # float16 has more mantissa than bfloat16 and runs the same kernels: held to bf16's budget
    "float16": {"out": 5e-3, "grad": 1e-2, "dg": 2e-2},
    # float32 inputs on the CPU backend (the CUDA backend is held to the bf16 row)
    "float32": {"out": 1e-4, "grad": 1e-4, "dg": 1e-4},
    # float64 inputs compute in float64 (seen: ~1e-15)
    "float64": {"out": 1e-12, "grad": 1e-12, "dg": 1e-12},
}
_OUT_NAMES = ("o", "ht", "out", "final_state", "state", "new_state", "pool")
_GRAD_NAMES = ("grad", "dq", "dk", "dv", "dbeta", "dh0")


def tolerance(dtype_name: str, what: str) -> float:
    """The tolerance for inputs of dtype `dtype_name` ("bfloat16", "float16",
    "float32", "float64"); `what` is "o", "ht" (or "out", "final_state",
    "state"), "dg", or a gradient name "dq", "dk", "dv", "dbeta", "dh0"."""
    row = TOLERANCES.get(dtype_name)
    if row is None:
        raise ValueError(f"tolerance: no row for dtype {dtype_name!r} (have {sorted(TOLERANCES)})")
    if what in _OUT_NAMES:
        return row["out"]
    if what == "dg":
        return row["dg"]
    if what in _GRAD_NAMES:
        return row["grad"]
    raise ValueError(f"tolerance: unknown quantity {what!r}")


def rel_error(out, ref) -> float:
    """||out - ref||_2 / ||ref||_2 in float64 (||out - ref|| when ref is 0);
    inf when out holds NaN or Inf. NumPy arrays (or anything np.asarray takes)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"rel_error: shape {out.shape} != reference {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(out - ref))
    return num / den if den > 0 else num


def c_header() -> str:
    """The table as a C header for the checkers in dev/cpu (generated, never edited)."""
    codes = {"float32": "FQ_F32", "float16": "FQ_F16", "bfloat16": "FQ_BF16", "float64": "FQ_F64"}
    lines = ["/* Generated from flashqla/reference.py (TOLERANCES) by dev/Makefile: do not edit. */",
             "#ifndef FQ_DEV_TOLERANCE_H", "#define FQ_DEV_TOLERANCE_H", '#include "gdn.h"',
             "typedef enum { FQ_TOL_OUT, FQ_TOL_GRAD, FQ_TOL_DG } fq_tol_what;",
             "/* rel = ||out - ref|| / ||ref|| limit for inputs of dtype dt; 0 for an unknown dtype */",
             "static inline double fq_tolerance(fq_dtype dt, fq_tol_what what)", "{",
             "    switch (dt) {"]
    for name, code in codes.items():
        r = TOLERANCES[name]
        lines.append(f"    case {code}: return what == FQ_TOL_OUT ? {r['out']!r} : "
                     f"what == FQ_TOL_GRAD ? {r['grad']!r} : {r['dg']!r};")
    lines += ["    }", "    return 0;", "}", "#endif", ""]
    return "\n".join(lines)


def _f64(x):
    return None if x is None else np.array(x, dtype=np.float64, copy=True)


def _shapes(q, k, v, g, beta):
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q, k: expected equal shapes [B,T,H,K], got {q.shape} and {k.shape}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v: expected shape [B,T,HV,V] with B={B} T={T}, got {v.shape}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v: HV={HV} is not a multiple of H={H}")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g, beta: expected shape {(B, T, HV)}, got {g.shape} and {beta.shape}")
    return B, T, H, HV, K, V


def _sequences(B, T, cu_seqlens):
    """Yields (n, b, start, end): sequence n is rows start..end-1 of batch row b."""
    if cu_seqlens is None:
        for b in range(B):
            yield b, b, 0, T
        return
    cu = [int(c) for c in np.asarray(cu_seqlens).reshape(-1)]
    if B != 1 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: bad offsets {cu} for B={B}, T={T}")
    for n in range(len(cu) - 1):
        yield n, 0, cu[n], cu[n + 1]


def _num_sequences(B, cu_seqlens):
    return B if cu_seqlens is None else int(np.asarray(cu_seqlens).size) - 1


def l2norm(x):
    """y = x / sqrt(Σ x² + eps) over the last axis; returns (y, r) with r = 1/sqrt(...)."""
    r = 1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
    return x * r, r


def _l2norm_backward(x, r, dy):
    # forward: y = x r, r = (Σ x² + eps)^(-1/2)  =>  dx = r dy − r³ (x·dy) x
    return r * dy - r ** 3 * np.sum(x * dy, axis=-1, keepdims=True) * x


def _expand_heads(x, HV):
    """[L, H, K] -> [L, HV, K]: value head j reads q/k head j // (HV/H)."""
    return np.repeat(x, HV // x.shape[1], axis=1)


def _group_sum(dx, H):
    """[L, HV, K] -> [L, H, K]: the transpose of _expand_heads."""
    L, HV, K = dx.shape
    return dx.reshape(L, H, HV // H, K).sum(axis=2)


def _step(S, q, k, v, g, beta, scale):
    """One token for all value heads. S [HV,K,V]; q,k [HV,K]; v [HV,V]; g,beta [HV]."""
    a = np.exp(g)
    Sd = a[:, None, None] * S
    p = np.einsum("hkv,hk->hv", Sd, k)
    u = beta[:, None] * (v - p)
    S_new = Sd + k[:, :, None] * u[:, None, :]
    o = scale * np.einsum("hkv,hk->hv", S_new, q)
    return S_new, o, (a, Sd, p, u)


def _sequence_forward(q, k, v, g, beta, S0, scale, checkpoints=None, trajectory=None):
    """q,k [L,HV,K] (heads expanded), v [L,HV,V], g,beta [L,HV], S0 [HV,K,V].
    trajectory (a list): gets the state after every token."""
    L = q.shape[0]
    o = np.zeros(v.shape, dtype=np.float64)
    S = S0.copy()
    for t in range(L):
        if checkpoints is not None and t % CHECKPOINT_EVERY == 0:
            checkpoints.append(S.copy())
        S, o[t], _ = _step(S, q[t], k[t], v[t], g[t], beta[t], scale)
        if trajectory is not None:
            trajectory.append(S.copy())
    return o, S


def _sequence_backward(q, k, v, g, beta, S0, scale, do, dST):
    """Reverse mode of _sequence_forward; returns dq, dk (per value head), dv,
    dg, dbeta, dS0."""
    L = q.shape[0]
    checkpoints = []
    _sequence_forward(q, k, v, g, beta, S0, scale, checkpoints)
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    dg = np.zeros(g.shape)
    dbeta = np.zeros(beta.shape)
    dS = dST.copy()  # dL/dS_t, carried from the last token back to the first
    for seg in reversed(range(len(checkpoints))):
        start = seg * CHECKPOINT_EVERY
        end = min(L, start + CHECKPOINT_EVERY)
        # recompute the states S_{t-1} of this segment from its checkpoint
        prev = [checkpoints[seg]]
        for t in range(start, end - 1):
            prev.append(_step(prev[-1], q[t], k[t], v[t], g[t], beta[t], scale)[0])
        for t in reversed(range(start, end)):
            S_prev = prev[t - start]
            S_t, _, (a, Sd, p, u) = _step(S_prev, q[t], k[t], v[t], g[t], beta[t], scale)
            # forward: o_t = scale S_tᵀ q_t
            dS = dS + scale * q[t][:, :, None] * do[t][:, None, :]
            dq[t] = scale * np.einsum("hkv,hv->hk", S_t, do[t])
            # forward: S_t = Sd_t + k_t u_tᵀ
            dSd = dS.copy()
            dk[t] = np.einsum("hkv,hv->hk", dS, u)
            du = np.einsum("hkv,hk->hv", dS, k[t])
            # forward: u_t = β_t (v_t − p_t)
            dbeta[t] = np.sum(du * (v[t] - p), axis=-1)
            dv[t] = beta[t][:, None] * du
            dp = -beta[t][:, None] * du
            # forward: p_t = Sd_tᵀ k_t
            dSd += k[t][:, :, None] * dp[:, None, :]
            dk[t] += np.einsum("hkv,hv->hk", Sd, dp)
            # forward: Sd_t = a_t S_{t-1}, a_t = exp(g_t)
            dg[t] = a * np.sum(dSd * S_prev, axis=(1, 2))
            dS = a[:, None, None] * dSd
    return dq, dk, dv, dg, dbeta, dS


def _prepare(q, k, use_qk_l2norm):
    if not use_qk_l2norm:
        return q, k, None, None
    qn, rq = l2norm(q)
    kn, rk = l2norm(k)
    return qn, kn, rq, rk


def forward(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
            use_qk_l2norm=False):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state
    [N, HV, K, V]; cu_seqlens [N + 1]. Returns (o [B,T,HV,V], final_state
    [N,HV,K,V]), both float64."""
    o, ht, _ = _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, False)
    return o, ht


def _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, trajectories):
    """(o, final_state, the states after every token per sequence (a list;
    None unless trajectories)) for forward and states."""
    q, k, v, g, beta = (_f64(x) for x in (q, k, v, g, beta))
    B, T, H, HV, K, V = _shapes(q, k, v, g, beta)
    scale = K ** -0.5 if scale is None else float(scale)
    N = _num_sequences(B, cu_seqlens)
    h0 = np.zeros((N, HV, K, V)) if initial_state is None else _f64(initial_state)
    qn, kn, _, _ = _prepare(q, k, use_qk_l2norm)
    o = np.zeros((B, T, HV, V))
    ht = np.zeros((N, HV, K, V))
    trajs = [None] * N if trajectories else None
    for n, b, s, e in _sequences(B, T, cu_seqlens):
        traj = [] if trajectories else None
        o[b, s:e], ht[n] = _sequence_forward(
            _expand_heads(qn[b, s:e], HV), _expand_heads(kn[b, s:e], HV), v[b, s:e],
            g[b, s:e], beta[b, s:e], h0[n], scale, trajectory=traj)
        if trajectories:
            trajs[n] = np.stack(traj) if traj else np.zeros((0, HV, K, V))
    return o, ht, trajs


def backward(q, k, v, g, beta, do, *, dfinal_state=None, scale=None, initial_state=None,
             cu_seqlens=None, use_qk_l2norm=False):
    """q, k [B, T, H, K]; v, do [B, T, HV, V]; g, beta [B, T, HV];
    initial_state, dfinal_state [N, HV, K, V]; cu_seqlens [N + 1].
    Gradients of L = <o, do> + <final_state, dfinal_state> with respect to
    (q, k, v, g, beta, initial_state), float64. dq, dk are summed over each GVA
    head group and taken through the l2norm when use_qk_l2norm is set. The
    last entry is the gradient of the initial state (of the zero state when
    none is given)."""
    q, k, v, g, beta, do = (_f64(x) for x in (q, k, v, g, beta, do))
    B, T, H, HV, K, V = _shapes(q, k, v, g, beta)
    scale = K ** -0.5 if scale is None else float(scale)
    N = _num_sequences(B, cu_seqlens)
    h0 = np.zeros((N, HV, K, V)) if initial_state is None else _f64(initial_state)
    dht = np.zeros((N, HV, K, V)) if dfinal_state is None else _f64(dfinal_state)
    qn, kn, rq, rk = _prepare(q, k, use_qk_l2norm)
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    dg = np.zeros(g.shape)
    dbeta = np.zeros(beta.shape)
    dh0 = np.zeros(h0.shape)
    for n, b, s, e in _sequences(B, T, cu_seqlens):
        dqj, dkj, dv[b, s:e], dg[b, s:e], dbeta[b, s:e], dh0[n] = _sequence_backward(
            _expand_heads(qn[b, s:e], HV), _expand_heads(kn[b, s:e], HV), v[b, s:e],
            g[b, s:e], beta[b, s:e], h0[n], scale, do[b, s:e], dht[n])
        dq[b, s:e] = _group_sum(dqj, H)
        dk[b, s:e] = _group_sum(dkj, H)
    if use_qk_l2norm:
        dq = _l2norm_backward(q, rq, dq)
        dk = _l2norm_backward(k, rk, dk)
    return dq, dk, dv, dg, dbeta, dh0


def states(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
           use_qk_l2norm=False):
    """The state after every token: a list over sequences n of float64 arrays
    [L_n, HV, K, V] (entry t: the state after token t of the sequence). The
    speculative-verify intermediate states and the prefix-cache checkpoints
    are rows of these."""
    return _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, True)[2]


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def gates(a, b, *, A_log=None, dt_bias=None, use_gate_in_kernel=False,
          use_beta_sigmoid_in_kernel=False):
    """The fused gates (FLA 0.6.0): returns (g, beta) float64 from the raw
    a, b [.., HV]: g = -exp(A_log) softplus(a + dt_bias) with
    use_gate_in_kernel (else g = a), beta = sigmoid(b) with
    use_beta_sigmoid_in_kernel (else beta = b)."""
    a, b = _f64(a), _f64(b)
    g = a
    if use_gate_in_kernel:
        x = a + (0.0 if dt_bias is None else _f64(dt_bias))
        g = -np.exp(_f64(A_log)) * _softplus(x)
    return g, (_sigmoid(b) if use_beta_sigmoid_in_kernel else b)


def gates_backward(a, b, dg, dbeta, *, A_log=None, dt_bias=None, use_gate_in_kernel=False,
                   use_beta_sigmoid_in_kernel=False):
    """Reverse mode of gates(): from dL/dg, dL/dbeta returns (da, db, dA_log,
    ddt_bias); dA_log, ddt_bias [HV] are None without use_gate_in_kernel
    (ddt_bias None without dt_bias)."""
    a, b, dg, dbeta = (_f64(x) for x in (a, b, dg, dbeta))
    da, dA, ddt = dg, None, None
    if use_gate_in_kernel:
        # fwd: g = -exp(A_log) softplus(x), x = a + dt_bias
        x = a + (0.0 if dt_bias is None else _f64(dt_bias))
        e = np.exp(_f64(A_log))
        da = dg * (-e * _sigmoid(x))
        axes = tuple(range(a.ndim - 1))
        dA = np.sum(dg * (-e * _softplus(x)), axis=axes)
        ddt = None if dt_bias is None else np.sum(da, axis=axes)
    db = dbeta
    if use_beta_sigmoid_in_kernel:  # fwd: beta = sigmoid(b)
        s = _sigmoid(b)
        db = dbeta * s * (1.0 - s)
    return da, db, dA, ddt


def recurrent(q, k, v, g, beta, state, *, state_indices=None, scale=None, cu_seqlens=None,
              use_qk_l2norm=False):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; state_indices
    [N]; cu_seqlens [N + 1]. The recurrent step against a state pool
    [P,HV,K,V]: sequence n starts
    from slot state_indices[n] (n without indices) and writes its final state
    back there; a negative slot is padding (o rows 0, pool untouched). Returns
    (o, new_pool) and leaves `state` unchanged."""
    pool = _f64(state)
    q_ = np.asarray(q)
    B, T = q_.shape[:2]
    N = _num_sequences(B, cu_seqlens)
    slots = list(range(N)) if state_indices is None else \
        [int(s) for s in np.asarray(state_indices).reshape(-1)]
    h0 = np.stack([pool[s] if s >= 0 else np.zeros(pool.shape[1:]) for s in slots])
    o, ht = forward(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
                    use_qk_l2norm=use_qk_l2norm)
    for n, b, s, e in _sequences(B, T, cu_seqlens):
        if slots[n] < 0:
            o[b, s:e] = 0.0
        else:
            pool[slots[n]] = ht[n]
    return o, pool


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--c-header"]:
        sys.exit("usage: python3 flashqla/reference.py --c-header   (the tolerance table as C)")
    sys.stdout.write(c_header())
