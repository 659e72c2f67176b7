/*
 * gdn.h — the C API of flashqla: Gated DeltaNet (gated delta rule) kernels.
 *
 * No Python in here, and none in any backend: a C program can link the core.
 * One params struct carries sizes, dtypes and pointers; one entry point per
 * (operation, backend). Every entry point returns an fq_status; on failure the
 * message is kept (per thread) and fq_last_error() returns it. The core never
 * prints and never exits.
 *
 * The operator (per sequence n, value head j, tokens t = 1..T_n; DESIGN.md §1):
 *
 *     alpha_t = exp(g_t)                          g_t <= 0, a log-space decay
 *     u_t     = beta_t (v_t - alpha_t S_{t-1}^T k_t)
 *     S_t     = alpha_t S_{t-1} + k_t u_t^T        S in R^{K x V}
 *     o_t     = scale * S_t^T q_t
 *
 * with q/k head h = j / (HV / H) (grouped value heads), S_0 = h0[n, j] (zeros
 * when h0 is NULL) and S_T the final state ht[n, j].
 *
 * Full resets: a gate g_t <= FQ_GATE_RESET (-inf included) means alpha_t = 0
 * exactly (e^-100 < 4e-44 is below float's normal range anyway). The chunked
 * backends never form gamma_r - gamma_s across a reset (that would be
 * -inf - -inf): inside a chunk, with z_r the last reset at or before local
 * row r (-1 if none) and gamma_r = sum of g_u over z_r < u <= r (a cumsum that
 * restarts after each reset, always finite),
 *
 *     Gamma_rs           = z_r == z_s  ? e^{gamma_r - gamma_s}  : 0   (r >= s)
 *     e^{gamma_r}        = z_r == -1   ? e^{gamma_r}            : 0
 *     e^{gamma_C - gamma_r} = z_C == z_r ? e^{gamma_C - gamma_r} : 0
 *
 * and in the backward dg_u = 0 at a reset u, while the reverse cumsum that
 * turns dgamma into dg restarts at every reset.
 *
 * Layouts (all row-major and contiguous; the binding rejects anything else):
 *
 *     q, k, dq, dk        [B, T, H,  K]    dtype  p->dtype
 *     v, o, dv, do        [B, T, HV, V]    dtype  p->dtype
 *     g, beta, dg, dbeta  [B, T, HV]       dtype  p->gate_dtype
 *     h0, ht, dh0, dht    [N, HV, K, V]    dtype  p->state_dtype ([N, HV, V, K]
 *                                               with state_vk, as every state)
 *     state (pool)        [P, HV, K, V]    dtype  p->state_dtype
 *     cu_seqlens          [N + 1]          int32 or int64 (B == 1 then)
 *     state_indices       [N]              int32 or int64
 *
 * Without cu_seqlens, N = B and sequence n is row n of the batch (T tokens).
 * With cu_seqlens, B = 1 and sequence n is tokens cu_seqlens[n] ..
 * cu_seqlens[n+1]-1 (an empty sequence is allowed: its final state is its
 * initial state).
 *
 * Pointers are host pointers for the CPU backend and device pointers for the
 * CUDA backend (cu_seqlens and state_indices included).
 */
#ifndef FQ_GDN_H
#define FQ_GDN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A gate at or below this is a full reset (alpha = 0; see the top of this file). */
#define FQ_GATE_RESET (-100.0)

typedef enum {
    FQ_OK = 0,
    FQ_ERR_VALUE = 1,    /* a bad size, shape or value: maps to ValueError */
    FQ_ERR_TYPE = 2,     /* a dtype the backend does not take: TypeError   */
    FQ_ERR_NOMEM = 3,    /* host allocation failed: MemoryError             */
    FQ_ERR_CUDA = 4,     /* a CUDA call or launch failed: flashqla.Error    */
    FQ_ERR_UNSUPPORTED = 5, /* backend not built / feature not on backend   */
    FQ_ERR_INTERNAL = 6
} fq_status;

typedef enum {
    FQ_F32 = 0,
    FQ_F16 = 1,
    FQ_BF16 = 2,
    FQ_F64 = 3
} fq_dtype;

/* Size in bytes of one element of the dtype (0 for an unknown value). */
size_t fq_dtype_size(fq_dtype dt);
const char *fq_dtype_name(fq_dtype dt);

/* The message of the last failed call on this thread ("" if none). */
const char *fq_last_error(void);
/* Set the message (printf-style) and return `st`: for the backends. */
fq_status fq_fail(fq_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

typedef struct fq_gdn_params {
    /* ---- sizes ---- */
    int64_t B, T;        /* batch rows, tokens per row                         */
    int64_t H, HV;       /* q/k heads, value heads (HV % H == 0)               */
    int64_t K, V;        /* head dims of q/k and of v                          */
    int64_t N;           /* sequences: B, or len(cu_seqlens) - 1              */
    int64_t P;           /* state-pool slots (recurrent only; N without indices) */

    /* ---- dtypes ---- */
    fq_dtype dtype;       /* q, k, v, o and their gradients                   */
    fq_dtype gate_dtype;  /* g, beta, dg, dbeta                                */
    fq_dtype state_dtype; /* h0, ht, dh0, dht, state: F32 (F64 with F64 input) */

    /* ---- options ---- */
    double scale;         /* o = scale * S^T q; callers pass K^-1/2 by default */
    int use_qk_l2norm;    /* q, k <- q/||q||, k/||k|| per head (eps 1e-6), inside */

    /* ---- inputs ---- */
    const void *q, *k, *v, *g, *beta;
    const void *h0;             /* initial state or NULL (zeros)              */
    const void *cu_seqlens;     /* NULL, or N+1 offsets                       */
    int cu_seqlens_is_int64;    /* 1: int64, 0: int32                         */

    /* ---- forward outputs ---- */
    void *o;
    void *ht;                   /* final state or NULL (not requested)        */

    /* ---- backward: inputs and outputs ---- */
    const void *dout;           /* dL/do                                     */
    const void *dht;            /* dL/dht or NULL (zero)                     */
    void *dq, *dk, *dv, *dg, *dbeta;
    void *dh0;                  /* NULL when h0 is NULL                      */

    /* ---- recurrent step; chunk forward through a pool ---- */
    void *state;                /* [P, HV, K, V], read and updated in place  */
    const void *state_indices;  /* NULL, or N slot numbers; slot < 0: padding,
                                   the sequence is skipped (o written as 0);
                                   a slot >= 0 at most once (see below)     */
    int state_indices_is_int64;

    /* ---- serving options (issue 11); all off after fq_params_init ----
     *
     * Fused gates (FLA 0.6.0's names). use_gate_in_kernel: the g argument
     * holds the raw gate input a [B, T, HV] and the operator uses
     *     g = -exp(A_log[j]) * softplus(a + dt_bias[j])   (softplus(x) = x for x > 20)
     * use_beta_sigmoid_in_kernel: the beta argument holds the raw b and the
     * operator uses beta = sigmoid(b). In the chunk backward dg and dbeta
     * then receive dL/da and dL/db (the gradients of what was passed), and
     * dA_log, ddt_bias the sums over every token of every sequence. */
    int use_gate_in_kernel;
    int use_beta_sigmoid_in_kernel;
    const void *A_log;          /* [HV], gate_param_dtype; required with use_gate_in_kernel */
    const void *dt_bias;        /* [HV], gate_param_dtype, or NULL (no bias)  */
    fq_dtype gate_param_dtype;  /* A_log, dt_bias, dA_log, ddt_bias: F32 (F64 with F64 inputs) */
    void *dA_log;               /* chunk backward, use_gate_in_kernel: [HV] or NULL (not wanted) */
    void *ddt_bias;             /* chunk backward: [HV] or NULL; NULL when dt_bias is NULL */

    /* State layout of every state argument: h0, ht, dh0, dht, state,
     * intermediate_states, checkpoints. 0: [.., K, V] (element (k, v) at
     * k * V + v); 1: [.., V, K] (at v * K + k: FLA's state_v_first, the pools
     * of vLLM and FlashInfer). */
    int state_vk;

    /* Pool-indexed prefill (chunk forward only): with state != NULL, sequence
     * n starts from state[state_indices[n]] (slot n without indices; zeros for
     * a negative slot) and its final state is written back there (nothing for
     * a negative slot). h0 and ht must be NULL then. Non-negative slots must
     * be distinct (also in the recurrent step). The CUDA backend cannot read
     * the indices from the host: there a slot >= P counts as negative. */

    /* Prefix-cache checkpoints (chunk forward only). checkpoint_every > 0 (a
     * multiple of 64): for sequence n of length L_n, the state after
     * c * checkpoint_every tokens, c = 1 .. L_n / checkpoint_every, goes to row
     * cu_checkpoints[n] + c - 1 of checkpoints; cu_checkpoints[0] = 0,
     * cu_checkpoints[n+1] = cu_checkpoints[n] + L_n / checkpoint_every. The
     * buffer has fq_checkpoint_rows(p) rows (a bound from the sizes only:
     * B * (T / checkpoint_every)); rows from cu_checkpoints[N] on are zeros. */
    int64_t checkpoint_every;
    void *checkpoints;          /* [fq_checkpoint_rows(p), HV, K, V], state_dtype */
    void *cu_checkpoints;       /* [N + 1] int64, written                    */

    /* Speculative verify (recurrent step): intermediate_states != NULL gets
     * the state after token t of sequence n at [n, t] for t < its length
     * (other rows untouched); Ti >= T without cu_seqlens, >= every sequence's
     * length with it. no_state_update = 1 leaves the pool untouched. */
    void *intermediate_states;  /* [N, Ti, HV, K, V], state_dtype            */
    int64_t Ti;
    int no_state_update;

    /* Commit (fq_*_commit): pool slot state_indices[n] (slot n without
     * indices) <- intermediate_states[n, num_accepted[n] - 1] for every n with
     * a slot >= 0 and num_accepted[n] > 0; num_accepted[n] = 0 keeps the slot.
     * Uses N, HV, K, V, P, Ti, state_dtype, state, state_indices. */
    const void *num_accepted;   /* [N] int32 or int64                        */
    int num_accepted_is_int64;

    /* ---- execution ---- */
    int num_threads;            /* CPU: threads; <= 0 means the default       */
    void *stream;               /* CUDA: cudaStream_t to launch on            */
    int device;                 /* CUDA: device ordinal of every pointer      */
    void *workspace;            /* CUDA: caller-owned scratch (device memory) */
    size_t workspace_bytes;     /* its size; see fq_cuda_*_workspace_bytes     */
    int check_inputs;           /* CUDA: 1 = also check the contents (below),
                                   copying g, cu_seqlens, state_indices to the
                                   host: a synchronisation, not capturable   */
} fq_gdn_params;

/* Fill with zeros/NULLs and the defaults (scale = 0 means K^-1/2 is applied by
 * the caller; the core uses p->scale as given; check_inputs from
 * fq_check_inputs_default()). */
void fq_params_init(fq_gdn_params *p);
/* 1 when the environment variable FLASHQLA_CHECK_INPUTS is "1", else 0. */
int fq_check_inputs_default(void);

/* Rows of the checkpoints buffer: B * (T / checkpoint_every) (0 without
 * checkpoints). Depends on sizes only, so a CUDA caller can allocate it
 * without reading cu_seqlens. */
int64_t fq_checkpoint_rows(const fq_gdn_params *p);

/* Checks every size, pointer and dtype rule above, that no buffer the call
 * writes (o, ht, the gradients, the state pool, intermediate_states,
 * checkpoints, the workspace) shares a byte with any other argument, and the
 * contents (fq_check_contents) read as host memory. `op` is 'f' (chunk
 * forward), 'b' (chunk backward), 'r' (recurrent) or 'c' (commit). The CPU
 * backend calls it first. */
fq_status fq_check_params(const fq_gdn_params *p, char op);
/* The same checks without reading any contents (device memory): the CUDA
 * backend calls this one, then fq_check_contents on host copies when
 * p->check_inputs is set. */
fq_status fq_check_params_device(const fq_gdn_params *p, char op);
/* The contents, read as host memory: cu_seqlens starts at 0, never
 * decreases and ends at T; every state_indices entry is < P and no slot
 * >= 0 appears twice (two sequences would update one pool entry at once;
 * negative entries are padding and may repeat); every g <= 0 (no NaN, no
 * positive gate: g is log(alpha); with use_gate_in_kernel only no NaN a, the
 * fused gate being <= 0 by construction); with intermediate_states every
 * sequence fits its Ti rows; num_accepted (commit) in 0 .. Ti. Without the
 * check (CUDA by default) a repeated slot goes to its first sequence; each
 * later sequence that names it gets NaN outputs and leaves the pool alone
 * (recurrent step and pool-indexed prefill). */
fq_status fq_check_contents(const fq_gdn_params *p, char op);

/* ---------------------------------------------------------------- CPU ---- */
/* Default thread count: FLASHQLA_NUM_THREADS if set (> 0), else all cores. */
int fq_cpu_default_threads(void);

/* Chunked forward (DESIGN §2, C = 64): writes o and, if non-NULL, ht. */
fq_status fq_cpu_chunk_fwd(const fq_gdn_params *p);
/* Chunked backward: from dout (and dht) writes dq, dk, dv, dg, dbeta and, if
 * h0 was given, dh0. Recomputes every intermediate from the inputs. */
fq_status fq_cpu_chunk_bwd(const fq_gdn_params *p);
/* Recurrent step over T tokens per sequence, state pool updated in place
 * (unless no_state_update); writes o and, if given, intermediate_states. */
fq_status fq_cpu_recurrent(const fq_gdn_params *p);
/* The instruction set whose float kernels the CPU backend runs: "avx512",
 * "avx2", "neon" or "scalar". Chosen once, at the first call: the best one
 * this CPU runs (x86-64: cpuid at run time; AArch64: NEON, fixed at build
 * time), or the one named by FLASHQLA_CPU_ISA (auto | avx512 | avx2 | neon |
 * scalar). A forced set this CPU or build cannot run makes this and every CPU
 * entry point fail with FQ_ERR_UNSUPPORTED (an unknown name: FQ_ERR_VALUE),
 * naming what it can run. */
fq_status fq_cpu_isa(const char **name);
/* Commit of a verify step: see num_accepted above. */
fq_status fq_cpu_commit(const fq_gdn_params *p);

/* --------------------------------------------------------------- CUDA ---- */
/* 1 if the library was built with the CUDA backend, else 0 (then every
 * fq_cuda_* entry point returns FQ_ERR_UNSUPPORTED). */
int fq_cuda_built(void);
/* Device scratch the caller must provide in p->workspace for each call.
 * Depends only on sizes (B, T, H, HV, K, V, N, dtype), never on data. The
 * recurrent step uses its scratch only with cu_seqlens (the flag of their
 * validity): a call without cu_seqlens (decode, verify) may pass none. */
size_t fq_cuda_chunk_fwd_workspace_bytes(const fq_gdn_params *p);
size_t fq_cuda_chunk_bwd_workspace_bytes(const fq_gdn_params *p);
size_t fq_cuda_recurrent_workspace_bytes(const fq_gdn_params *p);
/* Same contracts as the CPU entry points. Asynchronous on p->stream: no host
 * synchronisation, no allocation, capturable in a CUDA graph. Invalid
 * cu_seqlens contents (not non-decreasing, not from 0 to T) cannot be seen
 * from the host without a synchronisation: the kernels then fill the outputs
 * with NaN instead of reading out of bounds. bfloat16 q, k, v must be
 * 16-byte aligned, and so must the forward's o on Hopper (the fused forward
 * stores it by 16 bytes, and where it splits a sequence for context
 * parallelism o's rows serve as its scratch until they are written; the
 * Python layer allocates o itself). */
fq_status fq_cuda_chunk_fwd(const fq_gdn_params *p);
fq_status fq_cuda_chunk_bwd(const fq_gdn_params *p);
fq_status fq_cuda_recurrent(const fq_gdn_params *p);
/* Commit (no workspace). State indices and num_accepted are device memory:
 * entries out of range (slot >= P, num_accepted > Ti or < 0) leave the slot
 * untouched instead of raising. */
fq_status fq_cuda_commit(const fq_gdn_params *p);

#ifdef __cplusplus
}
#endif

#endif /* FQ_GDN_H */
