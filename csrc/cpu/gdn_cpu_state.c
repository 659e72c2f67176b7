/*
 * gdn_cpu_state.c — the CPU backend's state traffic for the serving path
 * (issue 11): states of either layout loaded into / stored from the
 * row-major [K][ld] blocks the kernels work on, and the commit of a
 * speculative-verify step.
 *
 * Layouts (gdn.h, state_vk): [K][V] puts element (k, v) at k * V + v;
 * [V][K] (FLA's state_v_first, vLLM's and FlashInfer's pools) at v * K + k.
 * The [V][K] form is a transpose, done in 16 x 16 tiles so that both sides
 * stay in cache.
 */
#include "gdn_cpu.h"

#include <stdlib.h>
#include <string.h>

#define FQ_TILE 16

void fq_cpu_load_state_f32(float *S, int64_t ld, const void *base, fq_dtype dt, int64_t off, int64_t K,
                           int64_t V, int vk)
{
    if (!vk) {
        for (int64_t i = 0; i < K; i++) fq_cpu_load_f32(S + i * ld, base, dt, off + i * V, V);
        return;
    }
    /* stored row c (K values) is column c of S */
    for (int64_t c0 = 0; c0 < V; c0 += FQ_TILE)
        for (int64_t i0 = 0; i0 < K; i0 += FQ_TILE) {
            float t[FQ_TILE];
            const int64_t ni = K - i0 < FQ_TILE ? K - i0 : FQ_TILE;
            for (int64_t c = c0; c < c0 + FQ_TILE && c < V; c++) {
                fq_cpu_load_f32(t, base, dt, off + c * K + i0, ni);
                for (int64_t i = 0; i < ni; i++) S[(i0 + i) * ld + c] = t[i];
            }
        }
}

void fq_cpu_load_state_f64(double *S, int64_t ld, const void *base, fq_dtype dt, int64_t off, int64_t K,
                           int64_t V, int vk)
{
    if (!vk) {
        for (int64_t i = 0; i < K; i++) fq_cpu_load_f64(S + i * ld, base, dt, off + i * V, V);
        return;
    }
    for (int64_t c0 = 0; c0 < V; c0 += FQ_TILE)
        for (int64_t i0 = 0; i0 < K; i0 += FQ_TILE) {
            double t[FQ_TILE];
            const int64_t ni = K - i0 < FQ_TILE ? K - i0 : FQ_TILE;
            for (int64_t c = c0; c < c0 + FQ_TILE && c < V; c++) {
                fq_cpu_load_f64(t, base, dt, off + c * K + i0, ni);
                for (int64_t i = 0; i < ni; i++) S[(i0 + i) * ld + c] = t[i];
            }
        }
}

void fq_cpu_store_state_f32(void *base, fq_dtype dt, int64_t off, const float *S, int64_t ld, int64_t K,
                            int64_t V, int vk)
{
    if (!vk) {
        for (int64_t i = 0; i < K; i++) fq_cpu_store_f32(base, dt, off + i * V, S + i * ld, V);
        return;
    }
    for (int64_t c0 = 0; c0 < V; c0 += FQ_TILE)
        for (int64_t i0 = 0; i0 < K; i0 += FQ_TILE) {
            float t[FQ_TILE];
            const int64_t ni = K - i0 < FQ_TILE ? K - i0 : FQ_TILE;
            for (int64_t c = c0; c < c0 + FQ_TILE && c < V; c++) {
                for (int64_t i = 0; i < ni; i++) t[i] = S[(i0 + i) * ld + c];
                fq_cpu_store_f32(base, dt, off + c * K + i0, t, ni);
            }
        }
}

void fq_cpu_store_state_f64(void *base, fq_dtype dt, int64_t off, const double *S, int64_t ld, int64_t K,
                            int64_t V, int vk)
{
    if (!vk) {
        for (int64_t i = 0; i < K; i++) fq_cpu_store_f64(base, dt, off + i * V, S + i * ld, V);
        return;
    }
    for (int64_t c0 = 0; c0 < V; c0 += FQ_TILE)
        for (int64_t i0 = 0; i0 < K; i0 += FQ_TILE) {
            double t[FQ_TILE];
            const int64_t ni = K - i0 < FQ_TILE ? K - i0 : FQ_TILE;
            for (int64_t c = c0; c < c0 + FQ_TILE && c < V; c++) {
                for (int64_t i = 0; i < ni; i++) t[i] = S[(i0 + i) * ld + c];
                fq_cpu_store_f64(base, dt, off + c * K + i0, t, ni);
            }
        }
}

/* ------------------------------------------------------------- commit ---- */

/* pool[slot n] <- intermediate_states[n, num_accepted[n] - 1] (HV * K * V
 * elements, either layout: both buffers share it, so this is a copy). */
fq_status fq_cpu_commit(const fq_gdn_params *p)
{
    fq_status st = fq_check_params(p, 'c');
    if (st != FQ_OK) return st;
    const size_t es = fq_dtype_size(p->state_dtype);
    const int64_t per = p->HV * p->K * p->V;
    for (int64_t n = 0; n < p->N; n++) {
        const int64_t slot = p->state_indices ? fq_cpu_index(p->state_indices, p->state_indices_is_int64, n) : n;
        const int64_t a = fq_cpu_index(p->num_accepted, p->num_accepted_is_int64, n);
        if (slot < 0 || a <= 0) continue;
        memcpy((char *)p->state + (size_t)(slot * per) * es,
               (const char *)p->intermediate_states + (size_t)((n * p->Ti + a - 1) * per) * es,
               (size_t)per * es);
    }
    return FQ_OK;
}
