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
    p->check_inputs = fq_check_inputs_default();
}

int fq_check_inputs_default(void)
{
    const char *env = getenv("FLASHQLA_CHECK_INPUTS");
    return env && strcmp(env, "1") == 0;
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

/* ------------------------------------------------------------ aliasing ---- */

/* n1 * n2 * ... in bytes, saturating at UINT64_MAX (sizes from a C caller are
 * not bounded by anything else). */
static uint64_t sat_mul(uint64_t a, uint64_t b)
{
    if (a == 0 || b == 0) return 0;
    return a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

typedef struct {
    const char *name;
    const void *ptr;
    uint64_t bytes;
    int written;
} fq_extent;

/* Every buffer of the call with its byte extent (the layouts of gdn.h), the
 * ones the call writes marked. A written buffer must share no byte with any
 * other buffer: the kernels read inputs after writing outputs (a chunk's o
 * rows before the next chunk's v rows, the state pool while q, k, v stream
 * in), so an overlap gives silently wrong results. Inputs may alias each
 * other (q is k, say). */
static fq_status check_aliasing(const fq_gdn_params *p, char op)
{
    const uint64_t bt = sat_mul((uint64_t)p->B, (uint64_t)p->T);
    const uint64_t es = fq_dtype_size(p->dtype), gs = fq_dtype_size(p->gate_dtype);
    const uint64_t ss = fq_dtype_size(p->state_dtype);
    const uint64_t qk = sat_mul(sat_mul(sat_mul(bt, (uint64_t)p->H), (uint64_t)p->K), es);
    const uint64_t vo = sat_mul(sat_mul(sat_mul(bt, (uint64_t)p->HV), (uint64_t)p->V), es);
    const uint64_t ga = sat_mul(sat_mul(bt, (uint64_t)p->HV), gs);
    const uint64_t st1 = sat_mul(sat_mul(sat_mul((uint64_t)p->HV, (uint64_t)p->K), (uint64_t)p->V), ss);
    const uint64_t stN = sat_mul((uint64_t)p->N, st1);
    const uint64_t cu = sat_mul((uint64_t)(p->N + 1), p->cu_seqlens_is_int64 ? 8 : 4);
    const uint64_t ix = sat_mul((uint64_t)p->N, p->state_indices_is_int64 ? 8 : 4);
    const uint64_t pool = sat_mul((uint64_t)p->P, st1);
    const uint64_t gp = sat_mul((uint64_t)p->HV, fq_dtype_size(p->gate_param_dtype));
    const uint64_t inter = sat_mul(sat_mul((uint64_t)p->N, (uint64_t)p->Ti), st1);
    fq_extent e[32];
    int n = 0;
#define FQ_EXT(nm, pt, by, wr)                                          \
    do {                                                                \
        e[n].name = (nm); e[n].ptr = (pt); e[n].bytes = (by);           \
        e[n].written = (wr); n++;                                       \
    } while (0)
    FQ_EXT("q", p->q, qk, 0);
    FQ_EXT("k", p->k, qk, 0);
    FQ_EXT("v", p->v, vo, 0);
    FQ_EXT("g", p->g, ga, 0);
    FQ_EXT("beta", p->beta, ga, 0);
    FQ_EXT("cu_seqlens", p->cu_seqlens, cu, 0);
    FQ_EXT("state_indices", p->state_indices, ix, 0);
    FQ_EXT("workspace", p->workspace, (uint64_t)p->workspace_bytes, 1);
    if (p->use_gate_in_kernel) {
        FQ_EXT("A_log", p->A_log, gp, 0);
        FQ_EXT("dt_bias", p->dt_bias, gp, 0);
    }
    if (op == 'f') {
        FQ_EXT("initial_state", p->h0, stN, 0);
        FQ_EXT("o", p->o, vo, 1);
        FQ_EXT("final_state", p->ht, stN, 1);
        FQ_EXT("state", p->state, pool, 1);
        if (p->checkpoint_every > 0) {
            FQ_EXT("checkpoints", p->checkpoints, sat_mul((uint64_t)fq_checkpoint_rows(p), st1), 1);
            FQ_EXT("cu_checkpoints", p->cu_checkpoints, sat_mul((uint64_t)(p->N + 1), 8), 1);
        }
    } else if (op == 'c') {
        FQ_EXT("state", p->state, pool, 1);
        FQ_EXT("intermediate_states", p->intermediate_states, inter, 0);
        FQ_EXT("num_accepted", p->num_accepted, sat_mul((uint64_t)p->N, p->num_accepted_is_int64 ? 8 : 4), 0);
    } else if (op == 'b') {
        FQ_EXT("initial_state", p->h0, stN, 0);
        FQ_EXT("do", p->dout, vo, 0);
        FQ_EXT("dfinal_state", p->dht, stN, 0);
        FQ_EXT("dq", p->dq, qk, 1);
        FQ_EXT("dk", p->dk, qk, 1);
        FQ_EXT("dv", p->dv, vo, 1);
        FQ_EXT("dg", p->dg, ga, 1);
        FQ_EXT("dbeta", p->dbeta, ga, 1);
        FQ_EXT("dinitial_state", p->dh0, stN, 1);
        if (p->use_gate_in_kernel) {
            FQ_EXT("dA_log", p->dA_log, gp, 1);
            FQ_EXT("ddt_bias", p->ddt_bias, gp, 1);
        }
    } else {
        FQ_EXT("o", p->o, vo, 1);
        FQ_EXT("state", p->state, pool, !p->no_state_update);
        FQ_EXT("intermediate_states", p->intermediate_states, inter, 1);
    }
#undef FQ_EXT
    for (int i = 0; i < n; i++) {
        if (!e[i].written || !e[i].ptr || e[i].bytes == 0) continue;
        const uintptr_t a0 = (uintptr_t)e[i].ptr;
        const uintptr_t a1 = e[i].bytes > UINTPTR_MAX - a0 ? UINTPTR_MAX : a0 + (uintptr_t)e[i].bytes;
        for (int j = 0; j < n; j++) {
            if (j == i || !e[j].ptr || e[j].bytes == 0) continue;
            if (e[j].written && j < i) continue; /* that pair was reported from j */
            const uintptr_t b0 = (uintptr_t)e[j].ptr;
            const uintptr_t b1 = e[j].bytes > UINTPTR_MAX - b0 ? UINTPTR_MAX : b0 + (uintptr_t)e[j].bytes;
            if (a0 < b1 && b0 < a1)
                return fq_fail(FQ_ERR_VALUE,
                               "%s and %s overlap in memory: %s is written by this call and must "
                               "not share bytes with any other argument (pass a separate buffer)",
                               e[i].name, e[j].name, e[i].name);
        }
    }
    return FQ_OK;
}

/* ------------------------------------------------------------ contents ---- */

/* Element i of a gate array as a double, and whether it is a legal gate
 * (g <= 0: not NaN, not positive; -0, 0 and -inf are fine). */
static double gate_value(const void *g, fq_dtype dt, int64_t i)
{
    switch (dt) {
    case FQ_F32: return ((const float *)g)[i];
    case FQ_F64: return ((const double *)g)[i];
    case FQ_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)g)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case FQ_F16: {
        const uint16_t h = ((const uint16_t *)g)[i];
        const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        const double sign = (h & 0x8000) ? -1.0 : 1.0;
        if (e == 31) return m ? NAN : sign * INFINITY;
        return sign * (e ? ldexp(1024 + m, e - 25) : ldexp(m, -24));
    }
    }
    return NAN;
}

fq_status fq_check_contents(const fq_gdn_params *p, char op)
{
    const int64_t N = p->N;
    if (p->cu_seqlens) {
        int64_t prev = read_index(p->cu_seqlens, p->cu_seqlens_is_int64, 0);
        if (prev != 0)
            return fq_fail(FQ_ERR_VALUE, "cu_seqlens: must start at 0, got %lld", (long long)prev);
        for (int64_t i = 1; i <= N; i++) {
            int64_t c = read_index(p->cu_seqlens, p->cu_seqlens_is_int64, i);
            if (c < prev)
                return fq_fail(FQ_ERR_VALUE,
                               "cu_seqlens: must be non-decreasing, but cu_seqlens[%lld]=%lld "
                               "< cu_seqlens[%lld]=%lld",
                               (long long)i, (long long)c, (long long)(i - 1), (long long)prev);
            if (op == 'r' && p->intermediate_states && c - prev > p->Ti)
                return fq_fail(FQ_ERR_VALUE,
                               "intermediate_states: sequence %lld has %lld tokens, but the buffer "
                               "holds %lld per sequence",
                               (long long)(i - 1), (long long)(c - prev), (long long)p->Ti);
            prev = c;
        }
        if (prev != p->T)
            return fq_fail(FQ_ERR_VALUE, "cu_seqlens: must end at the token count T=%lld, got %lld",
                           (long long)p->T, (long long)prev);
    }
    if (p->state_indices) {
        /* each slot < P, and no non-negative slot twice: two sequences would
         * update one pool entry at the same time (negative = padding, may
         * repeat). One bit per slot. */
        unsigned char *seen = (unsigned char *)calloc((size_t)(p->P + 7) / 8, 1);
        if (!seen) return fq_fail(FQ_ERR_NOMEM, "state_indices: cannot allocate %lld bytes",
                                  (long long)((p->P + 7) / 8));
        fq_status st = FQ_OK;
        for (int64_t i = 0; i < N && st == FQ_OK; i++) {
            const int64_t s = read_index(p->state_indices, p->state_indices_is_int64, i);
            if (s < 0) continue;
            if (s >= p->P) {
                st = fq_fail(FQ_ERR_VALUE,
                             "state_indices: entry %lld is %lld, but the pool has %lld slots",
                             (long long)i, (long long)s, (long long)p->P);
            } else if (seen[s >> 3] & (1u << (s & 7))) {
                int64_t first = 0;
                while (read_index(p->state_indices, p->state_indices_is_int64, first) != s) first++;
                st = fq_fail(FQ_ERR_VALUE,
                             "state_indices: slot %lld appears twice (entries %lld and %lld); each "
                             "non-negative slot may belong to one sequence only (negative entries "
                             "are padding and may repeat)",
                             (long long)s, (long long)first, (long long)i);
            } else {
                seen[s >> 3] |= (unsigned char)(1u << (s & 7));
            }
        }
        free(seen);
        if (st != FQ_OK) return st;
    }
    if (op == 'c')
        for (int64_t i = 0; i < N; i++) {
            const int64_t a = read_index(p->num_accepted, p->num_accepted_is_int64, i);
            if (a < 0 || a > p->Ti)
                return fq_fail(FQ_ERR_VALUE,
                               "num_accepted: entry %lld is %lld, expected 0 .. %lld (the tokens of "
                               "intermediate_states)",
                               (long long)i, (long long)a, (long long)p->Ti);
        }
    /* g <= 0: one pass over the B*T*HV gates (a positive g is almost always
     * the decay alpha passed instead of log(alpha), or g and beta swapped).
     * With use_gate_in_kernel g holds the raw a, any sign: only NaN is bad
     * (the fused gate -exp(A_log) softplus(a + dt_bias) is <= 0 otherwise). */
    const int64_t ng = p->g ? p->B * p->T * p->HV : 0;
    for (int64_t i = 0; i < ng; i++) {
        const double x = gate_value(p->g, p->gate_dtype, i);
        if (p->use_gate_in_kernel) {
            if (x != x) {
                const int64_t tok = i / p->HV;
                return fq_fail(FQ_ERR_VALUE, "g: the raw gate input a is NaN at [%lld, %lld, %lld]",
                               (long long)(tok / p->T), (long long)(tok % p->T), (long long)(i % p->HV));
            }
            continue;
        }
        if (!(x <= 0.0)) { /* positive or NaN */
            const int64_t tok = i / p->HV; /* ng > 0: T >= 1 */
            return fq_fail(FQ_ERR_VALUE,
                           "g: got %g at [%lld, %lld, %lld]; g is the log-space decay, g <= 0 "
                           "(pass log(alpha), not alpha; are g and beta swapped?)",
                           x, (long long)(tok / p->T), (long long)(tok % p->T),
                           (long long)(i % p->HV));
        }
    }
    (void)op;
    return FQ_OK;
}

/* ---------------------------------------------------------- the checks ---- */

int64_t fq_checkpoint_rows(const fq_gdn_params *p)
{
    if (p->checkpoint_every <= 0) return 0;
    return p->B * (p->T / p->checkpoint_every);
}

/* The pool (state, P, state_indices) of a recurrent step, a pool-indexed
 * chunk forward or a commit; its contents are fq_check_contents'. */
static fq_status check_pool(const fq_gdn_params *p)
{
    if (!p->state) return fq_fail(FQ_ERR_VALUE, "state: the state pool is required");
    if (p->P < 1) return fq_fail(FQ_ERR_VALUE, "state: the pool needs at least one slot");
    if (!p->state_indices && p->P != p->N)
        return fq_fail(FQ_ERR_VALUE,
                       "state: without state_indices the pool must have N=%lld slots, got %lld",
                       (long long)p->N, (long long)p->P);
    return FQ_OK;
}

static fq_status check_gate_params(const fq_gdn_params *p, char op)
{
    if (!p->use_gate_in_kernel) {
        if (p->dA_log || p->ddt_bias)
            return fq_fail(FQ_ERR_VALUE, "dA_log, ddt_bias: only written with use_gate_in_kernel");
        return FQ_OK;
    }
    if (!p->A_log) return fq_fail(FQ_ERR_VALUE, "A_log: required with use_gate_in_kernel");
    if (p->gate_param_dtype != FQ_F32 && !(p->gate_param_dtype == FQ_F64 && p->dtype == FQ_F64))
        return fq_fail(FQ_ERR_TYPE, "A_log: expected float32 (float64 only with float64 inputs), got %s",
                       fq_dtype_name(p->gate_param_dtype));
    if (op == 'b' && p->ddt_bias && !p->dt_bias)
        return fq_fail(FQ_ERR_VALUE, "ddt_bias: only written when dt_bias is given");
    return FQ_OK;
}

/* A commit ('c'): no q, k, v, gates. */
static fq_status check_commit(const fq_gdn_params *p, int host_contents)
{
    if (p->N < 0 || p->HV < 1 || p->K < 1 || p->V < 1)
        return fq_fail(FQ_ERR_VALUE, "commit: expected N >= 0, HV, K, V >= 1, got N=%lld HV=%lld K=%lld V=%lld",
                       (long long)p->N, (long long)p->HV, (long long)p->K, (long long)p->V);
    if (p->state_dtype != FQ_F32 && p->state_dtype != FQ_F64)
        return fq_fail(FQ_ERR_TYPE, "state: expected float32 (or float64), got %s",
                       fq_dtype_name(p->state_dtype));
    if (!p->intermediate_states || p->Ti < 1)
        return fq_fail(FQ_ERR_VALUE, "intermediate_states: required, with at least one token per sequence");
    if (!p->num_accepted) return fq_fail(FQ_ERR_VALUE, "num_accepted: required");
    fq_status st = check_pool(p);
    if (st != FQ_OK) return st;
    if ((st = check_aliasing(p, 'c')) != FQ_OK) return st;
    return host_contents ? fq_check_contents(p, 'c') : FQ_OK;
}

/* Checks that need no device memory; cu_seqlens / state_indices / g contents
 * are checked here only when `host_contents` is set (CPU backend). */
static fq_status check_params(const fq_gdn_params *p, char op, int host_contents)
{
    if (op != 'f' && op != 'b' && op != 'r' && op != 'c')
        return fq_fail(FQ_ERR_INTERNAL, "fq_check_params: unknown op '%c'", op);
    if (op == 'c') return check_commit(p, host_contents);
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
    fq_status st = check_gate_params(p, op);
    if (st != FQ_OK) return st;

    int64_t N = p->N;
    if (p->cu_seqlens) {
        if (p->B != 1)
            return fq_fail(FQ_ERR_VALUE,
                           "cu_seqlens: packed sequences need batch size B == 1, got B=%lld",
                           (long long)p->B);
        if (N < 1)
            return fq_fail(FQ_ERR_VALUE, "cu_seqlens: expected at least 2 entries");
    } else if (N != p->B) {
        return fq_fail(FQ_ERR_VALUE, "without cu_seqlens N must equal B (%lld), got %lld",
                       (long long)p->B, (long long)N);
    }

    if (op == 'f') {
        if (!p->o) return fq_fail(FQ_ERR_VALUE, "o: output buffer required");
        if (p->state) { /* pool-indexed prefill */
            if (p->h0 || p->ht)
                return fq_fail(FQ_ERR_VALUE,
                               "state: a pool-indexed forward reads and writes the pool; "
                               "initial_state and final_state must be None");
            if ((st = check_pool(p)) != FQ_OK) return st;
        }
        if (p->checkpoint_every != 0) {
            if (p->checkpoint_every < 0 || p->checkpoint_every % 64 != 0)
                return fq_fail(FQ_ERR_VALUE,
                               "checkpoint_every: expected a positive multiple of 64 (the chunk size), "
                               "got %lld",
                               (long long)p->checkpoint_every);
            if (!p->checkpoints || !p->cu_checkpoints)
                return fq_fail(FQ_ERR_VALUE, "checkpoints, cu_checkpoints: buffers required "
                                             "with checkpoint_every");
        }
    } else if (op == 'b') {
        if (p->state || p->checkpoint_every)
            return fq_fail(FQ_ERR_VALUE, "state, checkpoint_every: the chunk backward takes neither "
                                         "(pool-indexed prefill and checkpoints are forward only)");
        if (!p->dout) return fq_fail(FQ_ERR_VALUE, "do: gradient of o required");
        if (!p->dq || !p->dk || !p->dv || !p->dg || !p->dbeta)
            return fq_fail(FQ_ERR_VALUE, "dq, dk, dv, dg and dbeta buffers are required");
        if (p->h0 && !p->dh0)
            return fq_fail(FQ_ERR_VALUE, "dinitial_state: buffer required when h0 is given");
    } else { /* 'r' */
        if (!p->o) return fq_fail(FQ_ERR_VALUE, "o: output buffer required");
        if ((st = check_pool(p)) != FQ_OK) return st;
        if (p->intermediate_states) {
            if (p->Ti < 1)
                return fq_fail(FQ_ERR_VALUE, "intermediate_states: expected at least one token per "
                                             "sequence, got %lld", (long long)p->Ti);
            if (!p->cu_seqlens && p->Ti < p->T)
                return fq_fail(FQ_ERR_VALUE,
                               "intermediate_states: holds %lld tokens per sequence, but T=%lld",
                               (long long)p->Ti, (long long)p->T);
        }
    }
    st = check_aliasing(p, op);
    if (st != FQ_OK) return st;
    return host_contents ? fq_check_contents(p, op) : FQ_OK;
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
