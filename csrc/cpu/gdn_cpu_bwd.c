/*
 * gdn_cpu_bwd.c — CPU chunked backward of the gated delta rule (DESIGN §2).
 *
 * fq_cpu_chunk_bwd(p): from q, k, v, g, beta (h0, cu_seqlens) and dout (dht)
 * writes dq, dk [B,T,H,K] (summed over each GVA group), dv [B,T,HV,V],
 * dg, dbeta [B,T,HV] and, with h0, dh0 [N,HV,K,V]. Nothing is saved from the
 * forward: per (sequence, value head) a forward pass over the chunks stores
 * each chunk's start state S (and Vn), then a reverse pass carries dS from
 * dht to dh0.
 * F32/F16/BF16 inputs are computed in float on the active kernel set (the
 * body gdn_cpu_bwd_impl.h compiled per instruction set in
 * gdn_cpu_kernels_<isa>.c), F64 in double (the same body instantiated here).
 *
 * ---------------------------------------------------------------------------
 * The per-chunk equations, as implemented (checked in float64 against the
 * token recurrence with torch.autograd and finite differences by
 * dev/cpu/derive_bwd.py, to ~1e-14).
 *
 * Chunk of c <= C = 64 rows r = 0..c-1 (local), S = state at chunk start,
 * Q, K (c x K, after the optional l2norm), V, dO (c x V), g, b (c):
 *
 *   forward (recomputed)
 *     gam_r  = sum_{s<=r} g_s;   gC = gam_{c-1};   eg_r = e^gam_r;   kd_r = e^(gC-gam_r)
 *     Gam_rs = e^(gam_r-gam_s)   (r >= s, else 0)
 *     KK     = K K^T
 *     L      = strict_lower(diag(b) (KK o Gam))
 *     A      = (I + L)^-1                       (forward substitution)
 *     Kb     = diag(b eg) K;   Vb = diag(b) V
 *     W      = A Kb;           U  = A Vb
 *     Vn     = U - W S
 *     P      = lower_incl(Q K^T o Gam)          (unscaled)
 *     O      = scale (diag(eg) Q S + P Vn)
 *     S'     = e^gC S + (diag(kd) K)^T Vn
 *
 *   backward, given dO and dS' (= dht for the last chunk)
 *     dVn    = scale P^T dO + diag(kd) K dS'
 *     dS     = e^gC dS' + scale (diag(eg) Q)^T dO - W^T dVn     (carried to the previous chunk)
 *     dP     = scale lower_incl(dO Vn^T)
 *     dQ     = scale diag(eg) dO S^T + M K               M  = dP o Gam
 *     dK     = diag(kd) Vn dS'^T + M^T Q + diag(b eg) dKb + Bm K + Bm^T K
 *     dW     = -dVn S^T;    dU = dVn
 *     dA     = dU Vb^T + dW Kb^T                  (strict lower part suffices)
 *     dVb    = A^T dU;      dKb = A^T dW
 *     dV     = diag(b) dVb
 *     dL     = -strict_lower(A^T dA A^T)
 *     G      = dL o Gam;    Bm = diag(b) G
 *     db_r   = v_r.dVb_r + eg_r k_r.dKb_r + sum_s G_rs KK_rs
 *     dgam_r = e^gC <S, dS'> [r = c-1]
 *            + eg_r q_r.(scale dO S^T)_r
 *            + b_r eg_r k_r.dKb_r
 *            + sum_{s<r} E_rs - sum_{s>r} E_sr        E  = dP o P   (off-diagonal)
 *            + sum_{s<r} E2_rs - sum_{s>r} E2_sr      E2 = dL o L
 *     t_r    = kd_r k_r.(Vn dS'^T)_r
 *     dg_m   = sum_{r>=m} dgam_r + sum_{r<m} t_r
 *            = sum_{r>=m} dgam'_r + sum_{r>=m} sum_{s<m} (E + E2)_rs + sum_{r<m} t_r
 *              (dgam' = dgam without the E, E2 terms: those cancel for pairs
 *              r > s >= m, and are summed as the crossing sum, never cancelled)
 *
 *   The kd terms go straight to dg as the exclusive prefix sum of t (kd_r
 *   depends on g_m for m > r), and the diagonal of E is left out (Gam_rr = 1):
 *   the algebraically equal "dgam_r -= t_r, dgam_{c-1} += sum t" and "+E_rr -
 *   E_rr" cancel O(1) terms in rounding, which ruins dg under strong decay
 *   (true dg ~ e^g there).
 *
 *   after the reverse pass: dh0 = dS of the first chunk (dht for an empty
 *   sequence); with use_qk_l2norm, per token and q/k head (dq_hat summed over
 *   the group's value heads): dq = (dq_hat - q_hat (q_hat . dq_hat)) / sqrt(|q|^2 + 1e-6),
 *   the same for k.
 * ---------------------------------------------------------------------------
 *
 * Implementation notes (gdn_cpu_bwd_impl.h):
 *   - pass 1 (forward over chunks) keeps S (K x V) and Vn (C x V) of every
 *     chunk; pass 2 recomputes Gam, KK, L, A, Wn from the inputs (not U, Vn).
 *     Scratch per thread: ceil(T_max / 64) * (K V + 64 V) + 2 T_max K reals
 *     plus ~40 chunk-sized buffers (T_max = longest sequence).
 *   - W and Kb are kept negated (Wn = -W = A Kbn, Kbn = -diag(b eg) K), so
 *     every product is C = s C + A B on fq_cpu_gemm_*; dWn = dVn S^T,
 *     dKbn = A^T dWn, dA = dU Vb^T + dWn Kbn^T (same dA as above).
 *   - products with a triangular left factor (A, M, Bm; P^T, M^T, A^T, Bm^T)
 *     run on fq_cpu_trmm_lower/_upper, and the C^3 steps of A and dL are row
 *     axpys over the triangle only: nothing multiplies a structural zero,
 *     so a NaN at one token reaches only the gradients that depend on it
 *     (dq_r: tokens <= r; dk_r, dv_r, ...: as the token recurrence says).
 *   - full resets (g <= FQ_GATE_RESET, gdn.h): gam restarts after each,
 *     Gam, eg, kd are 0 across one, dg = 0 at one and the reverse cumsum of
 *     dgam restarts there.
 *   - gam is summed in double also for float inputs: under strong decay gam
 *     reaches ~ -1e3 inside a chunk, and a float gam_r - gam_s would lose
 *     ~1e-4 of the exponent (dg error 4e-5 -> 3e-7 in the fp32 test).
 *
 * Threads: items are (sequence, q/k head) pairs, the group's value heads in a
 * loop inside, dq/dk summed in the thread's accumulators (mode A); when there
 * are fewer such pairs than threads and HV > H, items are (sequence, value
 * head) pairs writing per-value-head dq/dk to a [B*T, HV, K] buffer, summed
 * over each group by a second parallel-for (mode B). Sequences are handed
 * out longest first. Every output element is written exactly once.
 *
 * Checked by dev/cpu/check_bwd.c against a naive float64 BPTT of the
 * recurrence (fp64 ~1e-15, fp32 ~1e-6, bf16 ~2e-3 relative).
 */
#include "gdn_cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define REAL double
#define FQ_SFX f64
#define FQ_EXP exp
#include "gdn_cpu_bwd_impl.h"
#undef REAL
#undef FQ_SFX

typedef struct {
    int64_t n, len;
} fq_seq_len;

static int seq_len_desc(const void *a, const void *b)
{
    const fq_seq_len *x = (const fq_seq_len *)a, *y = (const fq_seq_len *)b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->n < y->n ? -1 : (x->n > y->n);
}

fq_status fq_cpu_chunk_bwd(const fq_gdn_params *p)
{
    fq_status st = fq_check_params(p, 'b');
    if (st != FQ_OK) return st;
    const fq_cpu_kernels *kern;
    st = fq_cpu_kernels_get(&kern);
    if (st != FQ_OK) return st;

    /* sequences, longest first, so that the last items handed out are short */
    const int64_t N = p->N;
    fq_seq_len *sl = (fq_seq_len *)malloc((size_t)N * sizeof *sl);
    int64_t *order = (int64_t *)malloc((size_t)N * sizeof *order);
    if (!sl || !order) {
        free(sl);
        free(order);
        return fq_fail(FQ_ERR_NOMEM, "chunk_bwd: cannot allocate %lld sequence entries",
                       (long long)N);
    }
    int64_t Tmax = 0;
    for (int64_t n = 0; n < N; n++) {
        int64_t row, first, len;
        fq_cpu_seq_bounds(p, n, &row, &first, &len);
        sl[n].n = n;
        sl[n].len = len;
        if (len > Tmax) Tmax = len;
    }
    qsort(sl, (size_t)N, sizeof *sl, seq_len_desc);
    for (int64_t n = 0; n < N; n++) order[n] = sl[n].n;
    free(sl);

    if (p->dtype == FQ_F64) st = chunk_bwd_run_f64(p, order, Tmax);
    else st = kern->bwd_run(p, order, Tmax);
    free(order);
    return st;
}
