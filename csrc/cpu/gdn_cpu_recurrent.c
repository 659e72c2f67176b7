/*
 * gdn_cpu_recurrent.c — CPU recurrent step of the gated delta rule (DESIGN §1)
 * for decoding (T = 1) and multi-token verification (T = 2..8; any T works):
 * token by token over each sequence, reading and updating the state pool
 * [P, HV, K, V] in place at slot state_indices[n] (or n). A negative slot
 * marks padding: the sequence is skipped, its o rows are written as 0 and the
 * pool is left untouched.
 *
 * Work items (sequence, value head) are spread over threads. F32/F16/BF16
 * inputs compute in float, F64 in double (gdn_cpu_recurrent_impl.h
 * instantiated twice).
 */
#include "gdn_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FQ_NB 32 /* state columns per block (K x 32 values stay in L1)  */
#define FQ_TG 64 /* tokens loaded and run per block pass                */

#if defined(__AVX512F__)
#include <immintrin.h>
#define FQ_REC_AVX512 1 /* float instantiation: AVX-512 block kernel */
#else
#define FQ_REC_AVX512 0
#endif

typedef struct {
    const fq_gdn_params *p;
    void **scratch; /* one block per thread */
} fq_rec_ctx;

#define REAL float
#define FQ_SFX(name) name##_f32
#define FQ_LOAD fq_cpu_load_f32
#define FQ_STORE fq_cpu_store_f32
#define FQ_EXP fq_cpu_expf
#define FQ_L2NORM fq_cpu_l2norm_f32
#include "gdn_cpu_recurrent_impl.h"
#undef REAL
#undef FQ_SFX
#undef FQ_LOAD
#undef FQ_STORE
#undef FQ_EXP
#undef FQ_L2NORM

#undef FQ_REC_AVX512
#define FQ_REC_AVX512 0 /* double: the portable block kernel */
#define REAL double
#define FQ_SFX(name) name##_f64
#define FQ_LOAD fq_cpu_load_f64
#define FQ_STORE fq_cpu_store_f64
#define FQ_EXP exp
#define FQ_L2NORM fq_cpu_l2norm_f64
#include "gdn_cpu_recurrent_impl.h"
#undef REAL
#undef FQ_SFX
#undef FQ_LOAD
#undef FQ_STORE
#undef FQ_EXP
#undef FQ_L2NORM

fq_status fq_cpu_recurrent(const fq_gdn_params *p)
{
    fq_status st = fq_check_params(p, 'r');
    if (st != FQ_OK) return st;
    st = fq_cpu_check_dims(p);
    if (st != FQ_OK) return st;

    const int is64 = p->dtype == FQ_F64;
    fq_rec_ctx x;
    x.p = p;
    const int64_t n_items = p->N * p->HV;
    const int nt = fq_cpu_resolve_threads(n_items, p->num_threads);
    const size_t bytes = is64 ? rec_scratch_elems_f64(p->K, p->V) * sizeof(double)
                              : rec_scratch_elems_f32(p->K, p->V) * sizeof(float);
    const size_t abytes = (bytes + 63) / 64 * 64;

    x.scratch = calloc((size_t)nt, sizeof *x.scratch);
    if (!x.scratch) return fq_fail(FQ_ERR_NOMEM, "recurrent: cannot allocate scratch");
    for (int i = 0; i < nt; i++) {
        x.scratch[i] = aligned_alloc(64, abytes);
        if (!x.scratch[i]) {
            st = fq_fail(FQ_ERR_NOMEM, "recurrent: cannot allocate %zu bytes of scratch", abytes);
            goto done;
        }
    }
    st = fq_cpu_parallel_for(n_items, nt, is64 ? rec_item_f64 : rec_item_f32, &x);
done:
    for (int i = 0; i < nt; i++) free(x.scratch[i]);
    free(x.scratch);
    return st;
}
