/*
 * gdn_cpu_recurrent.c — CPU recurrent step of the gated delta rule (DESIGN §1)
 * for decoding (T = 1) and multi-token verification (T = 2..8; any T works):
 * token by token over each sequence, reading and updating the state pool
 * [P, HV, K, V] in place at slot state_indices[n] (or n). A negative slot
 * marks padding: the sequence is skipped, its o rows are written as 0 and the
 * pool is left untouched. Serving options (gdn.h): fused gates (computed per
 * token while loading), the [V, K] pool (and no_state_update) through a
 * [K][V] copy of the slot, intermediate_states after every token (groups of
 * one token then).
 *
 * Work items (sequence, value head) are spread over threads, no more than
 * leave each thread a few state blocks' worth of work (a small decode step
 * stays on fewer threads). F32/F16/BF16 inputs compute in float on the
 * active kernel set (gdn_cpu_recurrent_impl.h compiled per instruction set in
 * gdn_cpu_kernels_<isa>.c), F64 in double (the same body instantiated here
 * with the portable block kernel).
 */
#include "gdn_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

    const fq_cpu_kernels *kern;
    st = fq_cpu_kernels_get(&kern);
    if (st != FQ_OK) return st;

    const int is64 = p->dtype == FQ_F64;
    fq_rec_ctx x;
    x.p = p;
    const int64_t n_items = p->N * p->HV;
    /* an item reads and writes its K x V state once and runs its tokens over
     * it (about one state pass each): weigh it as 2 K V bytes per token */
    const double tokens = p->N > 0 ? (double)(p->B * p->T) / (double)p->N : 1.0;
    const double item_bytes = 2.0 * (double)p->K * (double)p->V *
                              (double)fq_dtype_size(p->state_dtype) * (tokens > 1.0 ? tokens : 1.0);
    const int nt = fq_cpu_resolve_threads_for_bytes(n_items, p->num_threads, item_bytes);
    const size_t bytes = is64 ? rec_scratch_elems_f64(p->K, p->V) * sizeof(double)
                              : kern->rec_scratch_elems(p->K, p->V) * sizeof(float);
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
    /* equal items (no cu_seqlens): runs of n / (4 nt) consecutive ones, so
     * each thread streams through contiguous parts of the pool (the decode
     * step is memory bound: measured 10-15 % faster at 2 threads than one
     * item at a time); varlen items one at a time, for the balance */
    const int64_t chunk = p->cu_seqlens ? 1 : (n_items + 4 * nt - 1) / (4 * nt);
    st = fq_cpu_parallel_for_chunked(n_items, nt, chunk, is64 ? rec_item_f64 : kern->rec_item, &x);
done:
    for (int i = 0; i < nt; i++) free(x.scratch[i]);
    free(x.scratch);
    return st;
}
