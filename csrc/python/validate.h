/*
 * validate.h — the arguments of one call and their checks (validate.c).
 * Internal: include after Python.h, dlpack.h, gdn.h and dlpack_import.h.
 */
#ifndef FQ_PY_VALIDATE_H
#define FQ_PY_VALIDATE_H

/* What an argument is, which fixes its dtype and shape rules. */
enum {
    FQ_QK,    /* [B, T, H, K], dtype of q; the first one is q itself    */
    FQ_V,     /* [B, T, HV, V], dtype of q; the first one is v          */
    FQ_GATE,  /* [B, T, HV], float32 or q's dtype; all alike            */
    FQ_SEQ,   /* cu_seqlens [N + 1], int32/int64 (B == 1)               */
    FQ_IDX,   /* state_indices [N], int32/int64                          */
    FQ_STATE, /* [N, HV, K, V] float32 (float64 with float64 inputs)    */
    FQ_POOL,  /* state pool [P, HV, K, V], state dtype (defines HV, K, V
                 when nothing before it did: the commit)                  */
    FQ_INTER, /* intermediate_states [N, Ti, HV, K, V], state dtype (defines
                 N when nothing before it did: the commit)                */
    FQ_CKPT,  /* checkpoints [B * (T / checkpoint_every), HV, K, V], state dtype */
    FQ_CUCK,  /* cu_checkpoints [N + 1], int64                           */
    FQ_ACC,   /* num_accepted [N], int32/int64                           */
    FQ_PARAM, /* A_log, dt_bias and their gradients [HV], float32 (float64
                 with float64 inputs); all alike                          */
    FQ_WS     /* workspace, uint8 CUDA scratch (ignored for CPU calls)  */
};
/* Every state kind (FQ_STATE, FQ_POOL, FQ_INTER, FQ_CKPT) ends in [K, V], or
 * [V, K] when the call's state_layout is "vk" (fq_call.vk). */

typedef struct {
    const char *name;
    int kind;
    int writable;   /* the core writes it                 */
    int required;
    PyObject *obj;  /* borrowed; NULL or None: not given  */
    fq_array a;
} fq_slot;

/* One call: its arguments in validation order (q first) and what the
 * validation learned. */
typedef struct {
    fq_slot *slots;
    int n;
    PyObject *dlpack_stream;  /* owned: the stream int given to CUDA producers */
    void *stream;             /* cudaStream_t for the core (NULL: legacy)     */
    DLDevice device;          /* q's device                                   */
    fq_dtype dtype, gate_dtype, state_dtype;
    int64_t B, T, H, HV, K, V, N, P;
    int seq_int64, idx_int64;
    int vk;                   /* set before validation: state_layout "vk"     */
    int64_t ck_every;         /* set before validation: checkpoint_every      */
    int64_t Ti;               /* intermediate_states' tokens per sequence     */
    fq_dtype param_dtype;     /* A_log, dt_bias, dA_log, ddt_bias             */
    int acc_int64;            /* num_accepted                                 */
    int exchange;             /* set before validation: take arrays through
                                 their type's DLPack C exchange API, and with
                                 stream None launch on the first array's
                                 producer's current stream (dlpack_import.h) */
} fq_call;

/* Imports every slot of `c` and checks them all; `stream` is the call's
 * stream argument (an int or None). On failure (-1, exception set) the
 * caller still runs fq_call_release. */
int fq_call_validate(fq_call *c, PyObject *stream);
/* Releases every imported argument; keeps a pending exception intact while
 * the producers' deleters run. */
void fq_call_release(fq_call *c);
/* Sizes, dtypes and options common to every op, into p. */
void fq_call_params(const fq_call *c, fq_gdn_params *p, double scale, int use_qk_l2norm,
                    int num_threads);
/* scale is a required keyword; None means the usual K^-1/2 (*use_default),
 * resolved once K is known. Checked before any array is imported. */
int fq_parse_scale(PyObject *obj, const char *fn, double *scale, int *use_default);
/* state_layout: None or "kv" -> 0, "vk" -> 1; anything else ValueError. */
int fq_parse_layout(PyObject *obj, int *vk);

#endif /* FQ_PY_VALIDATE_H */
