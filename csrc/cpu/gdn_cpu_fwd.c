/*
 * gdn_cpu_fwd.c — CPU chunked forward of the gated delta rule (DESIGN §2).
 *
 * Per sequence n and value head j, chunks of C = 64 tokens (the last may be
 * shorter), S the state at the chunk's start, gam the chunk-local cumulative
 * gate, Gamma_rs = e^{gam_r - gam_s}:
 *
 *     L   = strict_lower(diag(beta) (K K^T . Gamma))
 *     A   = (I + L)^-1                       (forward substitution, blocked)
 *     W   = A diag(beta e^gam) K,   U = A diag(beta) V
 *     Vn  = U - W S
 *     O   = scale (diag(e^gam) Q S + lower_incl_diag(Q K^T . Gamma) Vn)
 *     S'  = e^{gam_C} S + K^T diag(e^{gam_C - gam}) Vn
 *
 * The products run on a register-blocked micro-kernel. Work items (sequence,
 * value head) are spread over threads; each thread owns one scratch block
 * allocated once per call. F32/F16/BF16 inputs compute in float on the active
 * kernel set (gdn_cpu_fwd_impl.h compiled once per instruction set in
 * gdn_cpu_kernels_<isa>.c; the half-precision rows are converted as they are
 * loaded into the chunk's tiles), F64 in double (the same body instantiated
 * here, baseline code).
 */
#include "gdn_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define REAL double
#define FQ_SFX(name) name##_f64
#define FQ_LOAD fq_cpu_load_f64
#define FQ_STORE fq_cpu_store_f64
#define FQ_GEMM fq_cpu_gemm_f64
#define FQ_TRMM_LOWER fq_cpu_trmm_lower_f64
#define FQ_EXP exp
#define FQ_L2NORM fq_cpu_l2norm_f64
#include "gdn_cpu_fwd_impl.h"
#undef REAL
#undef FQ_SFX
#undef FQ_LOAD
#undef FQ_STORE
#undef FQ_GEMM
#undef FQ_TRMM_LOWER
#undef FQ_EXP
#undef FQ_L2NORM

/* Head dims and gate dtype rules shared by the CPU forward and recurrent step. */
fq_status fq_cpu_check_dims(const fq_gdn_params *p)
{
    if (p->K < 16 || p->K > 256)
        return fq_fail(FQ_ERR_VALUE, "q: head dim K=%lld not supported on the CPU backend "
                       "(expected 16 <= K <= 256)", (long long)p->K);
    if (p->V < 16 || p->V > 256)
        return fq_fail(FQ_ERR_VALUE, "v: head dim V=%lld not supported on the CPU backend "
                       "(expected 16 <= V <= 256)", (long long)p->V);
    if (p->gate_dtype != FQ_F32 && p->gate_dtype != p->dtype)
        return fq_fail(FQ_ERR_TYPE, "g: expected float32 or q's dtype %s, got %s",
                       fq_dtype_name(p->dtype), fq_dtype_name(p->gate_dtype));
    return FQ_OK;
}

/* cu_checkpoints[n] = sum_{m < n} L_m / checkpoint_every, and the rows past
 * the last checkpoint (the buffer's bound exceeds the count with cu_seqlens)
 * set to zero. */
static void fq_cpu_checkpoint_index(const fq_gdn_params *p)
{
    int64_t *cu = (int64_t *)p->cu_checkpoints, total = 0;
    for (int64_t n = 0; n < p->N; n++) {
        int64_t row, first, len;
        fq_cpu_seq_bounds(p, n, &row, &first, &len);
        cu[n] = total;
        total += len / p->checkpoint_every;
    }
    cu[p->N] = total;
    const size_t per = (size_t)(p->HV * p->K * p->V) * fq_dtype_size(p->state_dtype);
    const int64_t rows = fq_checkpoint_rows(p);
    if (rows > total) memset((char *)p->checkpoints + (size_t)total * per, 0, (size_t)(rows - total) * per);
}

fq_status fq_cpu_chunk_fwd(const fq_gdn_params *p)
{
    fq_status st = fq_check_params(p, 'f');
    if (st != FQ_OK) return st;
    st = fq_cpu_check_dims(p);
    if (st != FQ_OK) return st;

    const fq_cpu_kernels *kern;
    st = fq_cpu_kernels_get(&kern);
    if (st != FQ_OK) return st;
    if (p->checkpoint_every) fq_cpu_checkpoint_index(p);

    const int is64 = p->dtype == FQ_F64;
    const size_t esz = is64 ? sizeof(double) : sizeof(float);
    fq_fwd_ctx x;
    x.p = p;
    x.Kp = (p->K + 31) / 32 * 32;
    x.Vp = (p->V + 31) / 32 * 32;
    const int64_t n_items = p->N * p->HV;
    const int nt = fq_cpu_resolve_threads(n_items, p->num_threads);
    const size_t elems = is64 ? fwd_scratch_elems_f64(x.Kp, x.Vp) : kern->fwd_scratch_elems(x.Kp, x.Vp);
    const size_t bytes = (elems * esz + 63) / 64 * 64;

    x.scratch = calloc((size_t)nt, sizeof *x.scratch);
    if (!x.scratch) return fq_fail(FQ_ERR_NOMEM, "chunk_fwd: cannot allocate scratch");
    for (int i = 0; i < nt; i++) {
        x.scratch[i] = aligned_alloc(64, bytes);
        if (!x.scratch[i]) {
            st = fq_fail(FQ_ERR_NOMEM, "chunk_fwd: cannot allocate %zu bytes of scratch", bytes);
            goto done;
        }
        /* zero once: padding starts at 0 (fwd_item zeroes it again per item) */
        memset(x.scratch[i], 0, bytes);
    }
    st = fq_cpu_parallel_for(n_items, nt, is64 ? fwd_item_f64 : kern->fwd_item, &x);
done:
    for (int i = 0; i < nt; i++) free(x.scratch[i]);
    free(x.scratch);
    return st;
}
