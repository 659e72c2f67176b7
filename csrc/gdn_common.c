/*
 * gdn_common.c — what every backend shares: the error message, dtype names,
 * the params defaults and the checks of fq_check_params (gdn.h).
 */
#include "gdn.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(_MSC_VER)
#define FQ_THREAD_LOCAL __declspec(thread)
#else
#define FQ_THREAD_LOCAL _Thread_local
#endif

static FQ_THREAD_LOCAL char fq_error_message[1024];

const char *fq_last_error(void) { return fq_error_message; }

fq_status fq_fail(fq_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fq_error_message, sizeof fq_error_message, fmt, ap);
    va_end(ap);
    return st;
}

size_t fq_dtype_size(fq_dtype dt)
{
    switch (dt) {
    case FQ_F32: return 4;
    case FQ_F16: return 2;
    case FQ_BF16: return 2;
    case FQ_F64: return 8;
    }
    return 0;
}

const char *fq_dtype_name(fq_dtype dt)
{
    switch (dt) {
    case FQ_F32: return "float32";
    case FQ_F16: return "float16";
    case FQ_BF16: return "bfloat16";
    case FQ_F64: return "float64";
    }
    return "unknown";
}

void fq_params_init(fq_gdn_params *p)
{
    memset(p, 0, sizeof *p);
    p->dtype = FQ_F32;
    p->gate_dtype = FQ_F32;
    p->state_dtype = FQ_F32;
    p->scale = 1.0;
    p->num_threads = 0;
    p->device = 0;
}

int fq_cpu_default_threads(void)
{
    const char *env = getenv("FLASHQLA_NUM_THREADS");
    if (env && *env) {
        char *end = NULL;
        long n = strtol(env, &end, 10);
        if (end && *end == '\0' && n > 0 && n <= 4096) return (int)n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int64_t read_index(const void *base, int is_int64, int64_t i)
{
    return is_int64 ? ((const int64_t *)base)[i] : (int64_t)((const int32_t *)base)[i];
}

/* Checks that need no device memory; cu_seqlens / state_indices contents are
 * checked here only when `host_contents` is set (CPU backend). */
static fq_status check_params(const fq_gdn_params *p, char op, int host_contents)
{
    if (op != 'f' && op != 'b' && op != 'r')
        return fq_fail(FQ_ERR_INTERNAL, "fq_check_params: unknown op '%c'", op);
    if (p->B < 1 || p->T < 0)
        return fq_fail(FQ_ERR_VALUE, "q: expected B >= 1 and T >= 0, got B=%lld T=%lld",
                       (long long)p->B, (long long)p->T);
    if (p->H < 1 || p->HV < 1)
        return fq_fail(FQ_ERR_VALUE, "expected H >= 1 and HV >= 1, got H=%lld HV=%lld",
                       (long long)p->H, (long long)p->HV);
    if (p->HV % p->H != 0)
        return fq_fail(FQ_ERR_VALUE,
                       "v: the value heads HV=%lld must be a multiple of the q/k heads H=%lld",
                       (long long)p->HV, (long long)p->H);
    if (p->K < 1 || p->V < 1)
        return fq_fail(FQ_ERR_VALUE, "head dims must be >= 1, got K=%lld V=%lld",
                       (long long)p->K, (long long)p->V);
    if (fq_dtype_size(p->dtype) == 0 || fq_dtype_size(p->gate_dtype) == 0 ||
        fq_dtype_size(p->state_dtype) == 0)
        return fq_fail(FQ_ERR_TYPE, "unknown dtype code");
    if (p->state_dtype != FQ_F32 && p->state_dtype != FQ_F64)
        return fq_fail(FQ_ERR_TYPE, "state: expected float32 (or float64), got %s",
                       fq_dtype_name(p->state_dtype));
    if (p->state_dtype == FQ_F64 && p->dtype != FQ_F64)
        return fq_fail(FQ_ERR_TYPE, "state: float64 state needs float64 q/k/v, got %s",
                       fq_dtype_name(p->dtype));
    if (!p->q || !p->k || !p->v || !p->g || !p->beta)
        return fq_fail(FQ_ERR_VALUE, "q, k, v, g and beta are required");

    int64_t N = p->N;
    if (p->cu_seqlens) {
        if (p->B != 1)
            return fq_fail(FQ_ERR_VALUE,
                           "cu_seqlens: packed sequences need batch size B == 1, got B=%lld",
                           (long long)p->B);
        if (N < 1)
            return fq_fail(FQ_ERR_VALUE, "cu_seqlens: expected at least 2 entries");
        if (host_contents) {
            int64_t prev = read_index(p->cu_seqlens, p->cu_seqlens_is_int64, 0);
            if (prev != 0)
                return fq_fail(FQ_ERR_VALUE, "cu_seqlens: must start at 0, got %lld",
                               (long long)prev);
            for (int64_t i = 1; i <= N; i++) {
                int64_t c = read_index(p->cu_seqlens, p->cu_seqlens_is_int64, i);
                if (c < prev)
                    return fq_fail(FQ_ERR_VALUE,
                                   "cu_seqlens: must be non-decreasing, but cu_seqlens[%lld]=%lld "
                                   "< cu_seqlens[%lld]=%lld",
                                   (long long)i, (long long)c, (long long)(i - 1), (long long)prev);
                prev = c;
            }
            if (prev != p->T)
                return fq_fail(FQ_ERR_VALUE,
                               "cu_seqlens: must end at the token count T=%lld, got %lld",
                               (long long)p->T, (long long)prev);
        }
    } else if (N != p->B) {
        return fq_fail(FQ_ERR_VALUE, "without cu_seqlens N must equal B (%lld), got %lld",
                       (long long)p->B, (long long)N);
    }

    if (op == 'f') {
        if (!p->o) return fq_fail(FQ_ERR_VALUE, "o: output buffer required");
    } else if (op == 'b') {
        if (!p->dout) return fq_fail(FQ_ERR_VALUE, "do: gradient of o required");
        if (!p->dq || !p->dk || !p->dv || !p->dg || !p->dbeta)
            return fq_fail(FQ_ERR_VALUE, "dq, dk, dv, dg and dbeta buffers are required");
        if (p->h0 && !p->dh0)
            return fq_fail(FQ_ERR_VALUE, "dinitial_state: buffer required when h0 is given");
    } else { /* 'r' */
        if (!p->o) return fq_fail(FQ_ERR_VALUE, "o: output buffer required");
        if (!p->state) return fq_fail(FQ_ERR_VALUE, "state: the state pool is required");
        if (p->P < 1) return fq_fail(FQ_ERR_VALUE, "state: the pool needs at least one slot");
        if (!p->state_indices && p->P != N)
            return fq_fail(FQ_ERR_VALUE,
                           "state: without state_indices the pool must have N=%lld slots, got %lld",
                           (long long)N, (long long)p->P);
        if (p->state_indices && host_contents) {
            for (int64_t i = 0; i < N; i++) {
                int64_t s = read_index(p->state_indices, p->state_indices_is_int64, i);
                if (s >= p->P)
                    return fq_fail(FQ_ERR_VALUE,
                                   "state_indices: entry %lld is %lld, but the pool has %lld slots",
                                   (long long)i, (long long)s, (long long)p->P);
            }
        }
    }
    return FQ_OK;
}

fq_status fq_check_params(const fq_gdn_params *p, char op)
{
    /* The CUDA backend passes device pointers: it calls check_params through
     * fq_check_params_device (below) so that contents are never read. */
    return check_params(p, op, 1);
}

/* For the CUDA backend: the same checks without reading cu_seqlens or
 * state_indices (device memory). Declared in gdn_cuda_common.cuh. */
fq_status fq_check_params_device(const fq_gdn_params *p, char op)
{
    return check_params(p, op, 0);
}
