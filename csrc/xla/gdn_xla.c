/*
 * gdn_xla.c — the XLA FFI handlers of gdn_xla.h, written against the XLA FFI
 * C API (xla/ffi/api/c_api.h: jaxlib's copy or csrc/third_party's).
 *
 * One call, in order:
 *   1. preamble   a metadata query (XLA asks which API version and traits the
 *                 handler has) is answered and returns; stages other than
 *                 EXECUTE have nothing to do.
 *   2. attributes the flags and scale, looked up by name.
 *   3. buffers    arguments and results walked in the order of gdn_xla.h;
 *                 sizes read from q and v, every buffer's dtype mapped and its
 *                 element count checked against them (XLA hands raw pointers:
 *                 this is what keeps the core inside its buffers).
 *   4. run        fq_cpu_* on the calling thread, or fq_cuda_* on XLA's stream
 *                 with scratch from XLA's allocator; a failed status becomes
 *                 an XLA_FFI_Error with the core's message.
 */
#include "gdn_xla.h"

#include "gdn.h"

#ifndef FQ_HAVE_XLA_FFI

const fq_xla_target *fq_xla_targets(int *n)
{
    *n = 0;
    return 0;
}

const char *fq_xla_api_version(void) { return ""; }

#else /* FQ_HAVE_XLA_FFI */

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

#define FQ_XLA_STR2(x) #x
#define FQ_XLA_STR(x) FQ_XLA_STR2(x)
/* XLA's device allocator refuses alignments above its own (seen on the
 * H200: "Unsupported alignment: 256", and 64 too: XLA's FFI allows 16 at most): ask
 * for 16 and round the start up to
 * the 256 bytes the workspace layouts use. */
#define FQ_XLA_WORKSPACE_ALIGN 16
#define FQ_XLA_WORKSPACE_PAD 256

typedef enum { FQ_XLA_CPU, FQ_XLA_CUDA } fq_xla_platform;

/* ============================================================== errors == */

static XLA_FFI_Error *fq_xla_error(const XLA_FFI_Api *api, XLA_FFI_Error_Code code,
                                   const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* An error for XLA to raise (it copies the message). */
static XLA_FFI_Error *fq_xla_error(const XLA_FFI_Api *api, XLA_FFI_Error_Code code,
                                   const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    XLA_FFI_Error_Create_Args args;
    memset(&args, 0, sizeof args);
    args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    args.message = msg;
    args.errc = code;
    return api->XLA_FFI_Error_Create(&args);
}

/* A failed core status as an XLA error with the core's message. */
static XLA_FFI_Error *fq_xla_status(const XLA_FFI_Api *api, fq_status st)
{
    XLA_FFI_Error_Code code = XLA_FFI_Error_Code_INTERNAL;
    if (st == FQ_ERR_VALUE || st == FQ_ERR_TYPE) code = XLA_FFI_Error_Code_INVALID_ARGUMENT;
    else if (st == FQ_ERR_NOMEM) code = XLA_FFI_Error_Code_RESOURCE_EXHAUSTED;
    else if (st == FQ_ERR_UNSUPPORTED) code = XLA_FFI_Error_Code_UNIMPLEMENTED;
    const char *msg = fq_last_error();
    return fq_xla_error(api, code, "flashqla: %s", msg && *msg ? msg : "the C core failed");
}

/* ============================================================ preamble == */

/* Step 1. Returns an error, or NULL with *done set when there is nothing
 * more to do (a metadata query, a stage before EXECUTE). */
static XLA_FFI_Error *fq_xla_preamble(XLA_FFI_CallFrame *frame, int *done)
{
    const XLA_FFI_Api *api = frame->api;
    *done = 1;
    if (frame->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE)
        return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                            "flashqla: XLA's call frame is %zu bytes, expected at least %zu",
                            frame->struct_size, (size_t)XLA_FFI_CallFrame_STRUCT_SIZE);
    if (frame->extension_start && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
        XLA_FFI_Metadata_Extension *ext = (XLA_FFI_Metadata_Extension *)frame->extension_start;
        if (ext->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
            ext->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE)
            return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                "flashqla: XLA's metadata extension is too small");
        ext->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
        ext->metadata->api_version.extension_start = NULL;
        ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
        ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
        ext->metadata->traits = 0; /* not command-buffer safe: scratch comes per call */
        return NULL;
    }
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
    *done = 0;
    return NULL;
}

/* ========================================================== attributes == */

/* Step 2: the scalar attribute `name` as a double (*found 0 if absent). */
static XLA_FFI_Error *fq_xla_attr(const XLA_FFI_CallFrame *frame, const char *name, double *value,
                                  int *found)
{
    const XLA_FFI_Attrs *a = &frame->attrs;
    size_t len = strlen(name);
    *found = 0;
    for (int64_t i = 0; i < a->size; i++) {
        const XLA_FFI_ByteSpan *n = a->names[i];
        if (n->len != len || memcmp(n->ptr, name, len) != 0) continue;
        if (a->types[i] != XLA_FFI_AttrType_SCALAR)
            return fq_xla_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                "flashqla: attribute %s must be a scalar", name);
        const XLA_FFI_Scalar *s = (const XLA_FFI_Scalar *)a->attrs[i];
        switch (s->dtype) {
        case XLA_FFI_DataType_F64: *value = *(const double *)s->value; break;
        case XLA_FFI_DataType_F32: *value = *(const float *)s->value; break;
        case XLA_FFI_DataType_S64: *value = (double)*(const int64_t *)s->value; break;
        case XLA_FFI_DataType_S32: *value = *(const int32_t *)s->value; break;
        case XLA_FFI_DataType_PRED:
        case XLA_FFI_DataType_S8:
        case XLA_FFI_DataType_U8: *value = *(const uint8_t *)s->value; break;
        default:
            return fq_xla_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                "flashqla: attribute %s has an unsupported dtype %d", name,
                                (int)s->dtype);
        }
        *found = 1;
        return NULL;
    }
    return NULL;
}

/* A required scalar attribute. */
static XLA_FFI_Error *fq_xla_need(const XLA_FFI_CallFrame *frame, const char *name, double *value)
{
    int found = 0;
    XLA_FFI_Error *err = fq_xla_attr(frame, name, value, &found);
    if (err) return err;
    if (!found)
        return fq_xla_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                            "flashqla: missing attribute %s", name);
    return NULL;
}

/* ============================================================= buffers == */

/* What a buffer is, which fixes how its expected element count is formed. */
typedef enum { FQ_XB_QK, FQ_XB_V, FQ_XB_GATE, FQ_XB_STATE, FQ_XB_POOL, FQ_XB_SEQ, FQ_XB_IDX } fq_xla_kind;

typedef struct {
    const char *name;
    fq_xla_kind kind;
    XLA_FFI_Buffer *b;
} fq_xla_buf;

/* One call's buffers (arguments, then results) and what they tell. */
typedef struct {
    fq_xla_buf bufs[16];
    int n;
    int64_t B, T, H, HV, K, V, N, P;
} fq_xla_call;

static int64_t fq_xla_numel(const XLA_FFI_Buffer *b)
{
    int64_t n = 1;
    for (int64_t i = 0; i < b->rank; i++) n *= b->dims[i];
    return n;
}

/* Product of the dimensions in front of the last `tail` ones. */
static int64_t fq_xla_lead(const XLA_FFI_Buffer *b, int tail)
{
    int64_t n = 1;
    for (int64_t i = 0; i < b->rank - tail; i++) n *= b->dims[i];
    return n;
}

static int fq_xla_float(XLA_FFI_DataType t, fq_dtype *out)
{
    switch (t) {
    case XLA_FFI_DataType_F32: *out = FQ_F32; return 1;
    case XLA_FFI_DataType_F16: *out = FQ_F16; return 1;
    case XLA_FFI_DataType_BF16: *out = FQ_BF16; return 1;
    case XLA_FFI_DataType_F64: *out = FQ_F64; return 1;
    default: return 0;
    }
}

/* Appends argument (results: `ret`) number `i` of the frame as `name`. */
static XLA_FFI_Error *fq_xla_take(XLA_FFI_CallFrame *frame, fq_xla_call *c, int ret, int64_t i,
                                  const char *name, fq_xla_kind kind)
{
    int64_t size = ret ? frame->rets.size : frame->args.size;
    if (i >= size || c->n >= (int)(sizeof c->bufs / sizeof c->bufs[0]))
        return fq_xla_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                            "flashqla: %s: expected %s number %lld, the call has %lld", name,
                            ret ? "result" : "argument", (long long)i, (long long)size);
    int is_buffer = ret ? frame->rets.types[i] == XLA_FFI_RetType_BUFFER
                        : frame->args.types[i] == XLA_FFI_ArgType_BUFFER;
    if (!is_buffer)
        return fq_xla_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                            "flashqla: %s: expected a buffer", name);
    XLA_FFI_Buffer *b = (XLA_FFI_Buffer *)(ret ? frame->rets.rets[i] : frame->args.args[i]);
    c->bufs[c->n].name = name;
    c->bufs[c->n].kind = kind;
    c->bufs[c->n].b = b;
    c->n++;
    return NULL;
}

/* Step 3: sizes from q (the first buffer) and v (the third), then every
 * buffer's rank and element count against them. */
static XLA_FFI_Error *fq_xla_sizes(const XLA_FFI_Api *api, fq_xla_call *c, int has_cu)
{
    const XLA_FFI_Buffer *q = c->bufs[0].b, *v = c->bufs[2].b;
    if (q->rank < 4 || v->rank < 4)
        return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                            "flashqla: %s: expected [..., B, T, H, K] (rank >= 4), got rank %lld",
                            q->rank < 4 ? "q" : "v", (long long)(q->rank < 4 ? q->rank : v->rank));
    c->B = fq_xla_lead(q, 3);
    c->T = q->dims[q->rank - 3];
    c->H = q->dims[q->rank - 2];
    c->K = q->dims[q->rank - 1];
    c->HV = v->dims[v->rank - 2];
    c->V = v->dims[v->rank - 1];
    c->N = c->B;
    c->P = 0;
    if (has_cu) {
        for (int i = 0; i < c->n; i++)
            if (c->bufs[i].kind == FQ_XB_SEQ) {
                const XLA_FFI_Buffer *b = c->bufs[i].b;
                if (b->rank != 1 || b->dims[0] < 2)
                    return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                        "flashqla: cu_seqlens: expected [N + 1] with N >= 1");
                c->N = b->dims[0] - 1;
            }
    }
    for (int i = 0; i < c->n; i++) {
        const fq_xla_buf *x = &c->bufs[i];
        int64_t want = 0;
        switch (x->kind) {
        case FQ_XB_QK: want = c->B * c->T * c->H * c->K; break;
        case FQ_XB_V: want = c->B * c->T * c->HV * c->V; break;
        case FQ_XB_GATE: want = c->B * c->T * c->HV; break;
        case FQ_XB_STATE: want = c->N * c->HV * c->K * c->V; break;
        case FQ_XB_POOL:
            if (x->b->rank < 4 || x->b->dims[x->b->rank - 3] != c->HV ||
                x->b->dims[x->b->rank - 2] != c->K || x->b->dims[x->b->rank - 1] != c->V)
                return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                    "flashqla: %s: expected [P, HV=%lld, K=%lld, V=%lld]", x->name,
                                    (long long)c->HV, (long long)c->K, (long long)c->V);
            if (c->P == 0) c->P = fq_xla_lead(x->b, 3);
            want = c->P * c->HV * c->K * c->V;
            break;
        case FQ_XB_SEQ: want = c->N + 1; break;
        case FQ_XB_IDX: want = c->N; break;
        }
        if (fq_xla_numel(x->b) != want)
            return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                "flashqla: %s: %lld elements, expected %lld (B=%lld T=%lld H=%lld "
                                "HV=%lld K=%lld V=%lld N=%lld)",
                                x->name, (long long)fq_xla_numel(x->b), (long long)want,
                                (long long)c->B, (long long)c->T, (long long)c->H,
                                (long long)c->HV, (long long)c->K, (long long)c->V,
                                (long long)c->N);
    }
    return NULL;
}

/* The dtypes into p, checked: q's for q/k/v/o and their gradients, one gate
 * dtype, one state dtype, int32/int64 indices. */
static XLA_FFI_Error *fq_xla_dtypes(const XLA_FFI_Api *api, const fq_xla_call *c, fq_gdn_params *p)
{
    int have_gate = 0, have_state = 0;
    for (int i = 0; i < c->n; i++) {
        const fq_xla_buf *x = &c->bufs[i];
        fq_dtype d;
        int is_int = x->kind == FQ_XB_SEQ || x->kind == FQ_XB_IDX;
        if (is_int) {
            if (x->b->dtype != XLA_FFI_DataType_S32 && x->b->dtype != XLA_FFI_DataType_S64)
                return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                    "flashqla: %s: expected int32 or int64", x->name);
            int is64 = x->b->dtype == XLA_FFI_DataType_S64;
            if (x->kind == FQ_XB_SEQ) p->cu_seqlens_is_int64 = is64;
            else p->state_indices_is_int64 = is64;
            continue;
        }
        if (!fq_xla_float(x->b->dtype, &d))
            return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                "flashqla: %s: expected float32, float16, bfloat16 or float64 "
                                "(XLA dtype %d)", x->name, (int)x->b->dtype);
        if (i == 0) p->dtype = d;
        fq_dtype *slot = x->kind == FQ_XB_GATE ? &p->gate_dtype
                       : (x->kind == FQ_XB_STATE || x->kind == FQ_XB_POOL) ? &p->state_dtype
                       : &p->dtype;
        int *have = x->kind == FQ_XB_GATE ? &have_gate
                  : (x->kind == FQ_XB_STATE || x->kind == FQ_XB_POOL) ? &have_state : NULL;
        if (have && !*have) {
            *slot = d;
            *have = 1;
        } else if (d != *slot) {
            return fq_xla_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                "flashqla: %s: dtype %s, expected %s", x->name, fq_dtype_name(d),
                                fq_dtype_name(*slot));
        }
    }
    if (!have_state) p->state_dtype = p->dtype == FQ_F64 ? FQ_F64 : FQ_F32;
    return NULL;
}

/* ================================================================= run == */

/* Step 4: the op on the platform; `op` is 'f', 'b' or 'r'. */
static XLA_FFI_Error *fq_xla_run(XLA_FFI_CallFrame *frame, fq_gdn_params *p, char op,
                                 fq_xla_platform platform)
{
    const XLA_FFI_Api *api = frame->api;
    fq_status st;
    if (platform == FQ_XLA_CPU) {
        st = op == 'f' ? fq_cpu_chunk_fwd(p) : op == 'b' ? fq_cpu_chunk_bwd(p) : fq_cpu_recurrent(p);
        return st == FQ_OK ? NULL : fq_xla_status(api, st);
    }
    if (api->struct_size < XLA_FFI_Api_STRUCT_SIZE)
        return fq_xla_error(api, XLA_FFI_Error_Code_UNIMPLEMENTED,
                            "flashqla: this XLA's FFI API (%zu bytes) has no device ordinal "
                            "query; it needs XLA FFI >= 0.3", api->struct_size);
    XLA_FFI_Stream_Get_Args sa;
    memset(&sa, 0, sizeof sa);
    sa.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
    sa.ctx = frame->ctx;
    XLA_FFI_Error *err = api->XLA_FFI_Stream_Get(&sa);
    if (err) return err;
    XLA_FFI_DeviceOrdinal_Get_Args da;
    memset(&da, 0, sizeof da);
    da.struct_size = XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE;
    da.ctx = frame->ctx;
    err = api->XLA_FFI_DeviceOrdinal_Get(&da);
    if (err) return err;
    p->stream = sa.stream;
    p->device = (int)da.device_ordinal;

    size_t need = op == 'f'   ? fq_cuda_chunk_fwd_workspace_bytes(p)
                  : op == 'b' ? fq_cuda_chunk_bwd_workspace_bytes(p)
                              : fq_cuda_recurrent_workspace_bytes(p);
    XLA_FFI_DeviceMemory_Allocate_Args aa;
    memset(&aa, 0, sizeof aa);
    if (need > 0) {
        aa.struct_size = XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE;
        aa.ctx = frame->ctx;
        aa.size = need + FQ_XLA_WORKSPACE_PAD;
        aa.alignment = FQ_XLA_WORKSPACE_ALIGN;
        err = api->XLA_FFI_DeviceMemory_Allocate(&aa);
        if (err) return err;
        uintptr_t base = ((uintptr_t)aa.data + FQ_XLA_WORKSPACE_PAD - 1) & ~(uintptr_t)(FQ_XLA_WORKSPACE_PAD - 1);
        p->workspace = (void *)base;
        p->workspace_bytes = need;
    }
    st = op == 'f' ? fq_cuda_chunk_fwd(p) : op == 'b' ? fq_cuda_chunk_bwd(p) : fq_cuda_recurrent(p);
    err = st == FQ_OK ? NULL : fq_xla_status(api, st);
    if (need > 0) {
        /* Freed once the work is queued, as XLA's own ScratchAllocator does:
         * the allocator hands it out again only to work queued after ours. */
        XLA_FFI_DeviceMemory_Free_Args fa;
        memset(&fa, 0, sizeof fa);
        fa.struct_size = XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE;
        fa.ctx = frame->ctx;
        fa.size = need + FQ_XLA_WORKSPACE_PAD;
        fa.data = aa.data;
        XLA_FFI_Error *ferr = api->XLA_FFI_DeviceMemory_Free(&fa);
        if (ferr && !err) err = ferr;
        else if (ferr) {
            XLA_FFI_Error_Destroy_Args xa;
            memset(&xa, 0, sizeof xa);
            xa.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
            xa.error = ferr;
            api->XLA_FFI_Error_Destroy(&xa);
        }
    }
    return err;
}

#define FQ_XLA_TRY(expr)                      \
    do {                                      \
        XLA_FFI_Error *fq_xla_err_ = (expr);  \
        if (fq_xla_err_) return fq_xla_err_;  \
    } while (0)

/* ================================================================= ops == */

/* q, k, v, g, beta: arguments 0-4 of every op (buffers 0-4 of c); *a is
 * then the next argument. */
static XLA_FFI_Error *fq_xla_take_tokens(XLA_FFI_CallFrame *frame, fq_xla_call *c, int64_t *a)
{
    FQ_XLA_TRY(fq_xla_take(frame, c, 0, (*a)++, "q", FQ_XB_QK));
    FQ_XLA_TRY(fq_xla_take(frame, c, 0, (*a)++, "k", FQ_XB_QK));
    FQ_XLA_TRY(fq_xla_take(frame, c, 0, (*a)++, "v", FQ_XB_V));
    FQ_XLA_TRY(fq_xla_take(frame, c, 0, (*a)++, "g", FQ_XB_GATE));
    FQ_XLA_TRY(fq_xla_take(frame, c, 0, (*a)++, "beta", FQ_XB_GATE));
    return NULL;
}

/* Once every buffer is taken: the sizes and dtypes of the call, its options
 * and the q, k, v, g, beta pointers into p (the op sets the others). */
static XLA_FFI_Error *fq_xla_setup(XLA_FFI_CallFrame *frame, fq_xla_call *c, int has_cu, double scale, int l2,
                                   fq_gdn_params *p)
{
    FQ_XLA_TRY(fq_xla_sizes(frame->api, c, has_cu));
    fq_params_init(p);
    FQ_XLA_TRY(fq_xla_dtypes(frame->api, c, p));
    p->B = c->B;
    p->T = c->T;
    p->H = c->H;
    p->HV = c->HV;
    p->K = c->K;
    p->V = c->V;
    p->N = c->N;
    p->P = c->P;
    p->scale = scale;
    p->use_qk_l2norm = l2;
    p->num_threads = 0;
    p->q = c->bufs[0].b->data;
    p->k = c->bufs[1].b->data;
    p->v = c->bufs[2].b->data;
    p->g = c->bufs[3].b->data;
    p->beta = c->bufs[4].b->data;
    return NULL;
}


/* o, [ht] = chunk_fwd(q, k, v, g, beta, [h0], [cu]) */
static XLA_FFI_Error *fq_xla_chunk_fwd(XLA_FFI_CallFrame *frame, fq_xla_platform platform)
{
    int done;
    FQ_XLA_TRY(fq_xla_preamble(frame, &done));
    if (done) return NULL;
    double scale, l2, has_h0, has_cu, want_ht;
    FQ_XLA_TRY(fq_xla_need(frame, "scale", &scale));
    FQ_XLA_TRY(fq_xla_need(frame, "use_qk_l2norm", &l2));
    FQ_XLA_TRY(fq_xla_need(frame, "has_initial_state", &has_h0));
    FQ_XLA_TRY(fq_xla_need(frame, "has_cu_seqlens", &has_cu));
    FQ_XLA_TRY(fq_xla_need(frame, "output_final_state", &want_ht));
    fq_xla_call c;
    memset(&c, 0, sizeof c);
    int64_t a = 0;
    FQ_XLA_TRY(fq_xla_take_tokens(frame, &c, &a));
    int ih0 = has_h0 ? c.n : -1;
    if (has_h0) FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "initial_state", FQ_XB_STATE));
    int icu = has_cu ? c.n : -1;
    if (has_cu) FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "cu_seqlens", FQ_XB_SEQ));
    int io = c.n;
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 0, "o", FQ_XB_V));
    int iht = want_ht ? c.n : -1;
    if (want_ht) FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 1, "final_state", FQ_XB_STATE));
    fq_gdn_params p;
    FQ_XLA_TRY(fq_xla_setup(frame, &c, has_cu != 0, scale, l2 != 0, &p));
    p.h0 = ih0 >= 0 ? c.bufs[ih0].b->data : NULL;
    p.cu_seqlens = icu >= 0 ? c.bufs[icu].b->data : NULL;
    p.o = c.bufs[io].b->data;
    p.ht = iht >= 0 ? c.bufs[iht].b->data : NULL;
    return fq_xla_run(frame, &p, 'f', platform);
}

/* dq, dk, dv, dg, dbeta, [dh0] = chunk_bwd(q, k, v, g, beta, [h0], [cu], do, [dht]) */
static XLA_FFI_Error *fq_xla_chunk_bwd(XLA_FFI_CallFrame *frame, fq_xla_platform platform)
{
    int done;
    FQ_XLA_TRY(fq_xla_preamble(frame, &done));
    if (done) return NULL;
    double scale, l2, has_h0, has_cu, has_dht;
    FQ_XLA_TRY(fq_xla_need(frame, "scale", &scale));
    FQ_XLA_TRY(fq_xla_need(frame, "use_qk_l2norm", &l2));
    FQ_XLA_TRY(fq_xla_need(frame, "has_initial_state", &has_h0));
    FQ_XLA_TRY(fq_xla_need(frame, "has_cu_seqlens", &has_cu));
    FQ_XLA_TRY(fq_xla_need(frame, "has_dfinal_state", &has_dht));
    fq_xla_call c;
    memset(&c, 0, sizeof c);
    int64_t a = 0;
    FQ_XLA_TRY(fq_xla_take_tokens(frame, &c, &a));
    int ih0 = has_h0 ? c.n : -1;
    if (has_h0) FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "initial_state", FQ_XB_STATE));
    int icu = has_cu ? c.n : -1;
    if (has_cu) FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "cu_seqlens", FQ_XB_SEQ));
    int ido = c.n;
    FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "do", FQ_XB_V));
    int idht = has_dht ? c.n : -1;
    if (has_dht) FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "dfinal_state", FQ_XB_STATE));
    int idq = c.n;
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 0, "dq", FQ_XB_QK));
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 1, "dk", FQ_XB_QK));
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 2, "dv", FQ_XB_V));
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 3, "dg", FQ_XB_GATE));
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 4, "dbeta", FQ_XB_GATE));
    int idh0 = has_h0 ? c.n : -1;
    if (has_h0) FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 5, "dinitial_state", FQ_XB_STATE));
    fq_gdn_params p;
    FQ_XLA_TRY(fq_xla_setup(frame, &c, has_cu != 0, scale, l2 != 0, &p));
    p.h0 = ih0 >= 0 ? c.bufs[ih0].b->data : NULL;
    p.cu_seqlens = icu >= 0 ? c.bufs[icu].b->data : NULL;
    p.dout = c.bufs[ido].b->data;
    p.dht = idht >= 0 ? c.bufs[idht].b->data : NULL;
    p.dq = c.bufs[idq].b->data;
    p.dk = c.bufs[idq + 1].b->data;
    p.dv = c.bufs[idq + 2].b->data;
    p.dg = c.bufs[idq + 3].b->data;
    p.dbeta = c.bufs[idq + 4].b->data;
    p.dh0 = idh0 >= 0 ? c.bufs[idh0].b->data : NULL;
    return fq_xla_run(frame, &p, 'b', platform);
}

/* o, new_state = recurrent(q, k, v, g, beta, state, [state_indices], [cu]);
 * new_state is aliased to state: the step reads and updates it in place. */
static XLA_FFI_Error *fq_xla_recurrent(XLA_FFI_CallFrame *frame, fq_xla_platform platform)
{
    int done;
    FQ_XLA_TRY(fq_xla_preamble(frame, &done));
    if (done) return NULL;
    double scale, l2, has_idx, has_cu;
    FQ_XLA_TRY(fq_xla_need(frame, "scale", &scale));
    FQ_XLA_TRY(fq_xla_need(frame, "use_qk_l2norm", &l2));
    FQ_XLA_TRY(fq_xla_need(frame, "has_state_indices", &has_idx));
    FQ_XLA_TRY(fq_xla_need(frame, "has_cu_seqlens", &has_cu));
    fq_xla_call c;
    memset(&c, 0, sizeof c);
    int64_t a = 0;
    FQ_XLA_TRY(fq_xla_take_tokens(frame, &c, &a));
    int istate = c.n;
    FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "state", FQ_XB_POOL));
    int iidx = has_idx ? c.n : -1;
    if (has_idx) FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "state_indices", FQ_XB_IDX));
    int icu = has_cu ? c.n : -1;
    if (has_cu) FQ_XLA_TRY(fq_xla_take(frame, &c, 0, a++, "cu_seqlens", FQ_XB_SEQ));
    int io = c.n;
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 0, "o", FQ_XB_V));
    int inew = c.n;
    FQ_XLA_TRY(fq_xla_take(frame, &c, 1, 1, "new_state", FQ_XB_POOL));
    fq_gdn_params p;
    FQ_XLA_TRY(fq_xla_setup(frame, &c, has_cu != 0, scale, l2 != 0, &p));
    if (!has_idx && c.P != c.N)
        return fq_xla_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                            "flashqla: state: without state_indices the pool must have N=%lld "
                            "slots, got %lld", (long long)c.N, (long long)c.P);
    p.state_indices = iidx >= 0 ? c.bufs[iidx].b->data : NULL;
    p.cu_seqlens = icu >= 0 ? c.bufs[icu].b->data : NULL;
    p.o = c.bufs[io].b->data;
    /* the aliased result holds the pool (XLA copied `state` into it unless
     * the two are one buffer, as with a donated pool) */
    p.state = c.bufs[inew].b->data;
    (void)istate;
    return fq_xla_run(frame, &p, 'r', platform);
}

/* ============================================================ targets == */

static XLA_FFI_Error *fq_xla_chunk_fwd_cpu(XLA_FFI_CallFrame *f) { return fq_xla_chunk_fwd(f, FQ_XLA_CPU); }
static XLA_FFI_Error *fq_xla_chunk_bwd_cpu(XLA_FFI_CallFrame *f) { return fq_xla_chunk_bwd(f, FQ_XLA_CPU); }
static XLA_FFI_Error *fq_xla_recurrent_cpu(XLA_FFI_CallFrame *f) { return fq_xla_recurrent(f, FQ_XLA_CPU); }
static XLA_FFI_Error *fq_xla_chunk_fwd_cuda(XLA_FFI_CallFrame *f) { return fq_xla_chunk_fwd(f, FQ_XLA_CUDA); }
static XLA_FFI_Error *fq_xla_chunk_bwd_cuda(XLA_FFI_CallFrame *f) { return fq_xla_chunk_bwd(f, FQ_XLA_CUDA); }
static XLA_FFI_Error *fq_xla_recurrent_cuda(XLA_FFI_CallFrame *f) { return fq_xla_recurrent(f, FQ_XLA_CUDA); }

static const fq_xla_target fq_xla_all[] = {
    {"flashqla_chunk_fwd", "cpu", (void *)fq_xla_chunk_fwd_cpu},
    {"flashqla_chunk_bwd", "cpu", (void *)fq_xla_chunk_bwd_cpu},
    {"flashqla_recurrent", "cpu", (void *)fq_xla_recurrent_cpu},
    {"flashqla_chunk_fwd", "CUDA", (void *)fq_xla_chunk_fwd_cuda},
    {"flashqla_chunk_bwd", "CUDA", (void *)fq_xla_chunk_bwd_cuda},
    {"flashqla_recurrent", "CUDA", (void *)fq_xla_recurrent_cuda},
};

const fq_xla_target *fq_xla_targets(int *n)
{
    *n = fq_cuda_built() ? 6 : 3; /* the CUDA ones last */
    return fq_xla_all;
}

const char *fq_xla_api_version(void)
{
    return FQ_XLA_STR(XLA_FFI_API_MAJOR) "." FQ_XLA_STR(XLA_FFI_API_MINOR);
}

#endif /* FQ_HAVE_XLA_FFI */
