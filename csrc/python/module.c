/*
 * module.c — flashqla._C, the CPython binding of the C core (gdn.h): the op
 * table and the module init.
 *
 * The binding is the only part of the library that includes Python.h. It owns
 * every Python object and every reference count; the core sees a filled
 * fq_gdn_params. Its files, each calling only down the list:
 *
 *   module.c         the ops (chunk_fwd, chunk_bwd, recurrent, ...), dispatch
 *                    to fq_cpu_* / fq_cuda_* with the GIL released, the XLA
 *                    FFI handlers of csrc/xla handed to flashqla.jax, the module
 *   validate.c       the arguments of one call imported and checked in a
 *                    fixed order (dtype, shape, device, contiguity, data
 *                    pointer, read-only), then the fq_gdn_params filled
 *   dlpack_import.c  one array argument taken in as a DLPack tensor
 *   errors.c         flashqla._C.Error, status -> exception, message text
 *
 * One call, in order:
 *   1. import    every array argument as a DLPack tensor (dlpack_import.c).
 *   2. validate  in a fixed order, each message naming the argument
 *                (validate.c).
 *   3. dispatch  fill fq_gdn_params and call fq_cpu_* / fq_cuda_* with the
 *                GIL released; map a failed status to an exception.
 *   4. release   call every taken tensor's deleter (every path).
 *
 * Reference discipline: every PyObject * starts NULL; each function has one
 * fail: label that releases what it holds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"
#include "gdn.h"
#include "errors.h"
#include "dlpack_import.h"
#include "validate.h"
#include "xla/gdn_xla.h"

/* num_threads: absent or None: 0 (the default, FLASHQLA_NUM_THREADS or all
 * cores); else an int from 0 to 4096. */
static int fq_parse_num_threads(PyObject *obj, int *out)
{
    long long v = 0;
    *out = 0;
    if (!obj || obj == Py_None) return 0;
    if (fq_int_arg(obj, "num_threads", 0, 4096,
                   "an int from 0 (the default: FLASHQLA_NUM_THREADS or all cores) to 4096", &v) < 0)
        return -1;
    *out = (int)v;
    return 0;
}

/* ======================================================= fast arguments == */

/* The arguments of an op called with METH_FASTCALL | METH_KEYWORDS (the
 * decode step's: no keyword dict built, no name strings made per call), as
 * PyArg_ParseTupleAndKeywords would parse "O..O|$O..O", with its messages:
 * the first `npos` names are required, positional or by keyword, the others
 * keyword-only and optional. Names are matched by pointer against interned
 * copies (made once by fq_fastargs_init, kept for the process: the names a
 * Python call site passes are interned), then by text. */
typedef struct {
    const char *fname;
    const char *const *names; /* n names, NULL-terminated */
    int npos, n;
    PyObject **interned;      /* n interned names, from fq_fastargs_init */
} fq_fastargs;

static int fq_fastargs_init(fq_fastargs *f)
{
    if (f->interned) return 0;
    PyObject **in = PyMem_Calloc((size_t)f->n, sizeof *in);
    if (!in) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < f->n; i++) {
        in[i] = PyUnicode_InternFromString(f->names[i]);
        if (!in[i]) {
            for (int j = 0; j < i; j++) Py_DECREF(in[j]);
            PyMem_Free(in);
            return -1;
        }
    }
    f->interned = in;
    return 0;
}

/* out[i]: the object given for names[i] (borrowed), or NULL. */
static int fq_fastargs_parse(const fq_fastargs *f, PyObject *const *args, Py_ssize_t nargsf,
                             PyObject *kwnames, PyObject **out)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *unknown = NULL;
    for (int i = 0; i < f->n; i++) out[i] = i < nargs ? args[i] : NULL;
    if (nargs > f->npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)", f->fname,
                     f->npos, nargs);
        return -1;
    }
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j);
        int i = 0;
        while (i < f->n && key != f->interned[i]) i++;
        if (i == f->n) {
            if (!PyUnicode_Check(key)) {
                PyErr_SetString(PyExc_TypeError, "keywords must be strings");
                return -1;
            }
            i = 0;
            while (i < f->n && PyUnicode_CompareWithASCIIString(key, f->names[i]) != 0) i++;
        }
        if (i == f->n) {
            if (!unknown) unknown = key;
            continue;
        }
        if (i < nargs) {
            PyErr_Format(PyExc_TypeError, "argument for %s() given by name ('%s') and position (%d)",
                         f->fname, f->names[i], i + 1);
            return -1;
        }
        if (out[i]) { /* (a call from Python cannot repeat a keyword) */
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", f->fname,
                         f->names[i]);
            return -1;
        }
        out[i] = args[nargs + j];
    }
    for (int i = 0; i < f->npos; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", f->fname,
                         f->names[i], i + 1);
            return -1;
        }
    if (unknown) {
        PyErr_Format(PyExc_TypeError, "'%U' is an invalid keyword argument for %s()", unknown, f->fname);
        return -1;
    }
    return 0;
}

/* A "p" argument: absent keeps *out (the default), else its truth value. */
static int fq_bool_arg(PyObject *obj, int *out)
{
    if (!obj) return 0;
    int v = PyObject_IsTrue(obj);
    if (v < 0) return -1;
    *out = v;
    return 0;
}

/* Runs op 'f', 'b', 'r' or 'c' on the call's device with the GIL released.
 * `ws` is the workspace slot (imported only for CUDA calls; NULL: the op
 * takes none). */
static int fq_dispatch(char op, fq_gdn_params *p, const fq_call *c, const fq_slot *ws)
{
    fq_status st;
    if (c->device.device_type == kDLCPU) {
        Py_BEGIN_ALLOW_THREADS
        st = op == 'f' ? fq_cpu_chunk_fwd(p) : op == 'b' ? fq_cpu_chunk_bwd(p)
           : op == 'r' ? fq_cpu_recurrent(p) : fq_cpu_commit(p);
        Py_END_ALLOW_THREADS
    } else {
        /* the recurrent step's scratch serves cu_seqlens only (gdn.h): the
         * decode call goes without one, and without allocating one */
        size_t need = op == 'f'   ? fq_cuda_chunk_fwd_workspace_bytes(p)
                      : op == 'b' ? fq_cuda_chunk_bwd_workspace_bytes(p)
                      : op == 'r' && p->cu_seqlens ? fq_cuda_recurrent_workspace_bytes(p) : 0;
        if (ws && ws->a.t) {
            if ((uint64_t)ws->a.numel < (uint64_t)need) {
                PyErr_Format(PyExc_ValueError,
                             "workspace: needs at least %zu bytes (flashqla._C.workspace_bytes), got %lld",
                             need, (long long)ws->a.numel);
                return -1;
            }
            p->workspace = ws->a.data;
            p->workspace_bytes = (size_t)ws->a.numel;
        } else if (need > 0) {
            PyErr_Format(PyExc_ValueError,
                         "workspace: this call needs %zu bytes of CUDA scratch "
                         "(flashqla._C.workspace_bytes), got None",
                         need);
            return -1;
        }
        Py_BEGIN_ALLOW_THREADS
        st = op == 'f' ? fq_cuda_chunk_fwd(p) : op == 'b' ? fq_cuda_chunk_bwd(p)
           : op == 'r' ? fq_cuda_recurrent(p) : fq_cuda_commit(p);
        Py_END_ALLOW_THREADS
    }
    if (st != FQ_OK) {
        fq_raise_status(st);
        return -1;
    }
    return 0;
}

/* The fused-gate options into p (A_log, dt_bias are slots of the call). */
static void fq_set_gates(fq_gdn_params *p, int use_gate, int use_sig, const fq_slot *A_log,
                         const fq_slot *dt_bias)
{
    p->use_gate_in_kernel = use_gate;
    p->use_beta_sigmoid_in_kernel = use_sig;
    p->A_log = use_gate ? A_log->a.data : NULL;
    p->dt_bias = use_gate ? dt_bias->a.data : NULL;
}

/* ================================================================ ops ====== */

PyDoc_STRVAR(fq_chunk_fwd_doc,
"chunk_fwd(q, k, v, g, beta, o, *, scale, initial_state=None, final_state=None,\n"
"          cu_seqlens=None, use_qk_l2norm=False, state=None, state_indices=None,\n"
"          checkpoint_every=0, checkpoints=None, cu_checkpoints=None,\n"
"          state_layout=\"kv\", use_gate_in_kernel=False, A_log=None, dt_bias=None,\n"
"          use_beta_sigmoid_in_kernel=False, workspace=None, stream=None,\n"
"          num_threads=0) -> None\n\n"
"Chunked forward of the gated delta rule. Writes o [B,T,HV,V] and, if given,\n"
"final_state [N,HV,K,V] in place. q,k [B,T,H,K]; v [B,T,HV,V]; g,beta [B,T,HV];\n"
"initial_state [N,HV,K,V]; cu_seqlens [N+1] (B == 1). scale=None: K**-0.5.\n"
"state [P,HV,K,V] with state_indices [N]: pool-indexed prefill (read and\n"
"written in place; initial_state, final_state None). checkpoint_every (a\n"
"multiple of 64): writes checkpoints [B*(T//n),HV,K,V] and cu_checkpoints\n"
"[N+1] int64. state_layout \"vk\": every state [..,V,K]. Fused gates as in\n"
"FLA: g holds a (g = -exp(A_log) softplus(a + dt_bias)), beta holds b\n"
"(beta = sigmoid(b)).");

static PyObject *fq_chunk_fwd(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"q", "k", "v", "g", "beta", "o", "scale", "initial_state", "final_state",
                             "cu_seqlens", "use_qk_l2norm", "state", "state_indices", "checkpoint_every",
                             "checkpoints", "cu_checkpoints", "state_layout", "use_gate_in_kernel", "A_log",
                             "dt_bias", "use_beta_sigmoid_in_kernel", "workspace", "stream", "num_threads",
                             NULL};
    PyObject *q = NULL, *k = NULL, *v = NULL, *g = NULL, *beta = NULL, *o = NULL, *scale_obj = NULL;
    PyObject *h0 = NULL, *ht = NULL, *cu = NULL, *ws = NULL, *stream = NULL;
    PyObject *pool = NULL, *idx = NULL, *ck = NULL, *cuck = NULL, *layout = NULL, *alog = NULL, *dtb = NULL;
    PyObject *result = NULL;
    PyObject *nt_obj = NULL;
    int l2 = 0, num_threads = 0, use_gate = 0, use_sig = 0;
    long long ck_every = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO|$OOOOpOOLOOOpOOpOOO:chunk_fwd", kwlist, &q, &k, &v,
                                     &g, &beta, &o, &scale_obj, &h0, &ht, &cu, &l2, &pool, &idx, &ck_every,
                                     &ck, &cuck, &layout, &use_gate, &alog, &dtb, &use_sig, &ws, &stream,
                                     &nt_obj))
        return NULL;
    enum { Q, K, V, G, BETA, O, SEQ, IDX, H0, HT, POOL, CK, CUCK, ALOG, DTB, WS, NSLOT };
    fq_slot slots[NSLOT] = {
        {"q", FQ_QK, 0, 1, q, {0}},          {"k", FQ_QK, 0, 1, k, {0}},
        {"v", FQ_V, 0, 1, v, {0}},           {"g", FQ_GATE, 0, 1, g, {0}},
        {"beta", FQ_GATE, 0, 1, beta, {0}},  {"o", FQ_V, 1, 1, o, {0}},
        {"cu_seqlens", FQ_SEQ, 0, 0, cu, {0}}, {"state_indices", FQ_IDX, 0, 0, idx, {0}},
        {"initial_state", FQ_STATE, 0, 0, h0, {0}}, {"final_state", FQ_STATE, 1, 0, ht, {0}},
        {"state", FQ_POOL, 1, 0, pool, {0}}, {"checkpoints", FQ_CKPT, 1, 0, ck, {0}},
        {"cu_checkpoints", FQ_CUCK, 1, 0, cuck, {0}}, {"A_log", FQ_PARAM, 0, 0, alog, {0}},
        {"dt_bias", FQ_PARAM, 0, 0, dtb, {0}}, {"workspace", FQ_WS, 1, 0, ws, {0}},
    };
    fq_call c = {.slots = slots, .n = NSLOT};
    fq_gdn_params p;
    double scale = 0.0;
    int scale_default = 0;
    if (fq_parse_num_threads(nt_obj, &num_threads) < 0) return NULL;
    if (fq_parse_scale(scale_obj, "chunk_fwd", &scale, &scale_default) < 0) return NULL;
    if (fq_parse_layout(layout, &c.vk) < 0) return NULL;
    c.ck_every = ck_every;
    if (idx && idx != Py_None && (!pool || pool == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "state_indices: only with state (a pool-indexed forward)");
        return NULL;
    }
    if (fq_call_validate(&c, stream) < 0) goto fail;
    if (scale_default) scale = pow((double)c.K, -0.5); /* as Python's K ** -0.5 */
    fq_call_params(&c, &p, scale, l2, num_threads);
    p.q = slots[Q].a.data;
    p.k = slots[K].a.data;
    p.v = slots[V].a.data;
    p.g = slots[G].a.data;
    p.beta = slots[BETA].a.data;
    p.o = slots[O].a.data;
    p.cu_seqlens = slots[SEQ].a.data;
    p.h0 = slots[H0].a.data;
    p.ht = slots[HT].a.data;
    p.state = slots[POOL].a.data;
    p.state_indices = slots[IDX].a.data;
    p.checkpoints = slots[CK].a.data;
    p.cu_checkpoints = slots[CUCK].a.data;
    fq_set_gates(&p, use_gate, use_sig, &slots[ALOG], &slots[DTB]);
    if (fq_dispatch('f', &p, &c, &slots[WS]) < 0) goto fail;
    result = Py_NewRef(Py_None);
fail:
    fq_call_release(&c);
    return result;
}

PyDoc_STRVAR(fq_chunk_bwd_doc,
"chunk_bwd(q, k, v, g, beta, do, dq, dk, dv, dg, dbeta, *, scale,\n"
"          initial_state=None, dfinal_state=None, dinitial_state=None,\n"
"          cu_seqlens=None, use_qk_l2norm=False, state_layout=\"kv\",\n"
"          use_gate_in_kernel=False, A_log=None, dt_bias=None, dA_log=None,\n"
"          ddt_bias=None, use_beta_sigmoid_in_kernel=False, workspace=None,\n"
"          stream=None, num_threads=0) -> None\n\n"
"Chunked backward: from do (and dfinal_state) writes dq, dk [B,T,H,K],\n"
"dv [B,T,HV,V], dg, dbeta [B,T,HV] and, when initial_state is given,\n"
"dinitial_state [N,HV,K,V] in place. With fused gates dg, dbeta receive the\n"
"gradients of the raw a, b, and dA_log, ddt_bias [HV] those of the gate\n"
"parameters.");

static PyObject *fq_chunk_bwd(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"q", "k", "v", "g", "beta", "do", "dq", "dk", "dv", "dg", "dbeta", "scale",
                             "initial_state", "dfinal_state", "dinitial_state", "cu_seqlens",
                             "use_qk_l2norm", "state_layout", "use_gate_in_kernel", "A_log", "dt_bias",
                             "dA_log", "ddt_bias", "use_beta_sigmoid_in_kernel", "workspace", "stream",
                             "num_threads", NULL};
    PyObject *q = NULL, *k = NULL, *v = NULL, *g = NULL, *beta = NULL, *dout = NULL;
    PyObject *dq = NULL, *dk = NULL, *dv = NULL, *dg = NULL, *dbeta = NULL, *scale_obj = NULL;
    PyObject *h0 = NULL, *dht = NULL, *dh0 = NULL, *cu = NULL, *ws = NULL, *stream = NULL;
    PyObject *layout = NULL, *alog = NULL, *dtb = NULL, *dalog = NULL, *ddtb = NULL;
    PyObject *result = NULL;
    PyObject *nt_obj = NULL;
    int l2 = 0, num_threads = 0, use_gate = 0, use_sig = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOOO|$OOOOOpOpOOOOpOOO:chunk_bwd", kwlist, &q, &k,
                                     &v, &g, &beta, &dout, &dq, &dk, &dv, &dg, &dbeta, &scale_obj, &h0,
                                     &dht, &dh0, &cu, &l2, &layout, &use_gate, &alog, &dtb, &dalog, &ddtb,
                                     &use_sig, &ws, &stream, &nt_obj))
        return NULL;
    enum { Q, K, V, G, BETA, DO, DQ, DK, DV, DG, DBETA, SEQ, H0, DHT, DH0, ALOG, DTB, DALOG, DDTB, WS, NSLOT };
    fq_slot slots[NSLOT] = {
        {"q", FQ_QK, 0, 1, q, {0}},           {"k", FQ_QK, 0, 1, k, {0}},
        {"v", FQ_V, 0, 1, v, {0}},            {"g", FQ_GATE, 0, 1, g, {0}},
        {"beta", FQ_GATE, 0, 1, beta, {0}},   {"do", FQ_V, 0, 1, dout, {0}},
        {"dq", FQ_QK, 1, 1, dq, {0}},         {"dk", FQ_QK, 1, 1, dk, {0}},
        {"dv", FQ_V, 1, 1, dv, {0}},          {"dg", FQ_GATE, 1, 1, dg, {0}},
        {"dbeta", FQ_GATE, 1, 1, dbeta, {0}}, {"cu_seqlens", FQ_SEQ, 0, 0, cu, {0}},
        {"initial_state", FQ_STATE, 0, 0, h0, {0}}, {"dfinal_state", FQ_STATE, 0, 0, dht, {0}},
        {"dinitial_state", FQ_STATE, 1, 0, dh0, {0}}, {"A_log", FQ_PARAM, 0, 0, alog, {0}},
        {"dt_bias", FQ_PARAM, 0, 0, dtb, {0}}, {"dA_log", FQ_PARAM, 1, 0, dalog, {0}},
        {"ddt_bias", FQ_PARAM, 1, 0, ddtb, {0}}, {"workspace", FQ_WS, 1, 0, ws, {0}},
    };
    fq_call c = {.slots = slots, .n = NSLOT};
    fq_gdn_params p;
    double scale = 0.0;
    int scale_default = 0;
    if (fq_parse_num_threads(nt_obj, &num_threads) < 0) return NULL;
    if (fq_parse_scale(scale_obj, "chunk_bwd", &scale, &scale_default) < 0) return NULL;
    if (fq_parse_layout(layout, &c.vk) < 0) return NULL;
    if (fq_call_validate(&c, stream) < 0) goto fail;
    if (slots[H0].a.t && !slots[DH0].a.t) {
        PyErr_SetString(PyExc_ValueError,
                        "dinitial_state: required when initial_state is given (the gradient of h0)");
        goto fail;
    }
    if (!slots[H0].a.t && slots[DH0].a.t) {
        PyErr_SetString(PyExc_ValueError,
                        "dinitial_state: only written when initial_state is given; pass "
                        "initial_state or leave dinitial_state None");
        goto fail;
    }
    if (scale_default) scale = pow((double)c.K, -0.5); /* as Python's K ** -0.5 */
    fq_call_params(&c, &p, scale, l2, num_threads);
    p.q = slots[Q].a.data;
    p.k = slots[K].a.data;
    p.v = slots[V].a.data;
    p.g = slots[G].a.data;
    p.beta = slots[BETA].a.data;
    p.dout = slots[DO].a.data;
    p.dq = slots[DQ].a.data;
    p.dk = slots[DK].a.data;
    p.dv = slots[DV].a.data;
    p.dg = slots[DG].a.data;
    p.dbeta = slots[DBETA].a.data;
    p.cu_seqlens = slots[SEQ].a.data;
    p.h0 = slots[H0].a.data;
    p.dht = slots[DHT].a.data;
    p.dh0 = slots[DH0].a.data;
    fq_set_gates(&p, use_gate, use_sig, &slots[ALOG], &slots[DTB]);
    p.dA_log = slots[DALOG].a.data;
    p.ddt_bias = slots[DDTB].a.data;
    if (fq_dispatch('b', &p, &c, &slots[WS]) < 0) goto fail;
    result = Py_NewRef(Py_None);
fail:
    fq_call_release(&c);
    return result;
}

PyDoc_STRVAR(fq_recurrent_doc,
"recurrent(q, k, v, g, beta, state, o, *, scale, state_indices=None,\n"
"          cu_seqlens=None, use_qk_l2norm=False, intermediate_states=None,\n"
"          update_state=True, state_layout=\"kv\", use_gate_in_kernel=False,\n"
"          A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,\n"
"          workspace=None, stream=None, num_threads=0, exchange_api=False) -> None\n\n"
"Recurrent steps (decoding): updates the state pool [P,HV,K,V] in place and\n"
"writes o. state_indices [N] picks each sequence's slot (< 0: padding).\n"
"intermediate_states [N,Ti,HV,K,V] gets the state after each token;\n"
"update_state=False leaves the pool untouched (speculative verify). On CUDA\n"
"a workspace (flashqla._C.workspace_bytes) only with cu_seqlens.\n"
"exchange_api=True: arrays whose type has __dlpack_c_exchange_api__ (DLPack\n"
"1.3: PyTorch tensors) are taken through it, with no __dlpack__ call (none\n"
"of its checks, no stream hand-over: the caller made them, as for a\n"
"capsule), and with stream=None the call runs on q's producer's current\n"
"stream.");

static const char *const fq_recurrent_names[] = {
    "q", "k", "v", "g", "beta", "state", "o", "scale", "state_indices", "cu_seqlens", "use_qk_l2norm",
    "intermediate_states", "update_state", "state_layout", "use_gate_in_kernel", "A_log", "dt_bias",
    "use_beta_sigmoid_in_kernel", "workspace", "stream", "num_threads", "exchange_api", NULL};
static fq_fastargs fq_recurrent_args = {"recurrent", fq_recurrent_names, 7, 22, NULL};

static PyObject *fq_recurrent(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    enum { A_Q, A_K, A_V, A_G, A_BETA, A_STATE, A_O, A_SCALE, A_IDX, A_CU, A_L2, A_INTER, A_UPDATE,
           A_LAYOUT, A_GATE, A_ALOG, A_DTB, A_SIG, A_WS, A_STREAM, A_NT, A_EXCHANGE, A_N };
    PyObject *a[A_N];
    PyObject *result = NULL;
    int l2 = 0, num_threads = 0, update = 1, use_gate = 0, use_sig = 0, exchange = 0;
    (void)self;
    if (fq_fastargs_parse(&fq_recurrent_args, args, nargsf, kwnames, a) < 0) return NULL;
    if (fq_bool_arg(a[A_L2], &l2) < 0 || fq_bool_arg(a[A_UPDATE], &update) < 0 ||
        fq_bool_arg(a[A_GATE], &use_gate) < 0 || fq_bool_arg(a[A_SIG], &use_sig) < 0 ||
        fq_bool_arg(a[A_EXCHANGE], &exchange) < 0)
        return NULL;
    PyObject *q = a[A_Q], *k = a[A_K], *v = a[A_V], *g = a[A_G], *beta = a[A_BETA], *state = a[A_STATE];
    PyObject *o = a[A_O], *scale_obj = a[A_SCALE], *idx = a[A_IDX], *cu = a[A_CU], *ws = a[A_WS];
    PyObject *stream = a[A_STREAM], *inter = a[A_INTER], *layout = a[A_LAYOUT], *alog = a[A_ALOG];
    PyObject *dtb = a[A_DTB], *nt_obj = a[A_NT];
    enum { Q, K, V, G, BETA, O, SEQ, IDX, STATE, INTER, ALOG, DTB, WS, NSLOT };
    fq_slot slots[NSLOT] = {
        {"q", FQ_QK, 0, 1, q, {0}},         {"k", FQ_QK, 0, 1, k, {0}},
        {"v", FQ_V, 0, 1, v, {0}},          {"g", FQ_GATE, 0, 1, g, {0}},
        {"beta", FQ_GATE, 0, 1, beta, {0}}, {"o", FQ_V, 1, 1, o, {0}},
        {"cu_seqlens", FQ_SEQ, 0, 0, cu, {0}}, {"state_indices", FQ_IDX, 0, 0, idx, {0}},
        {"state", FQ_POOL, update, 1, state, {0}}, {"intermediate_states", FQ_INTER, 1, 0, inter, {0}},
        {"A_log", FQ_PARAM, 0, 0, alog, {0}}, {"dt_bias", FQ_PARAM, 0, 0, dtb, {0}},
        {"workspace", FQ_WS, 1, 0, ws, {0}},
    };
    fq_call c = {.slots = slots, .n = NSLOT, .exchange = exchange};
    fq_gdn_params p;
    double scale = 0.0;
    int scale_default = 0;
    if (fq_parse_num_threads(nt_obj, &num_threads) < 0) return NULL;
    if (fq_parse_scale(scale_obj, "recurrent", &scale, &scale_default) < 0) return NULL;
    if (fq_parse_layout(layout, &c.vk) < 0) return NULL;
    if (fq_call_validate(&c, stream) < 0) goto fail;
    if (scale_default) scale = pow((double)c.K, -0.5); /* as Python's K ** -0.5 */
    fq_call_params(&c, &p, scale, l2, num_threads);
    p.q = slots[Q].a.data;
    p.k = slots[K].a.data;
    p.v = slots[V].a.data;
    p.g = slots[G].a.data;
    p.beta = slots[BETA].a.data;
    p.o = slots[O].a.data;
    p.cu_seqlens = slots[SEQ].a.data;
    p.state_indices = slots[IDX].a.data;
    p.state = slots[STATE].a.data;
    p.intermediate_states = slots[INTER].a.data;
    p.no_state_update = !update;
    fq_set_gates(&p, use_gate, use_sig, &slots[ALOG], &slots[DTB]);
    if (fq_dispatch('r', &p, &c, &slots[WS]) < 0) goto fail;
    result = Py_NewRef(Py_None);
fail:
    fq_call_release(&c);
    return result;
}

/* ================================================ the decode hot path == */

/* What recurrent_hot needs of torch, handed over once by flashqla._torch
 * (recurrent_hot_init) and kept for the process: the tensor type, float32,
 * torch.empty_like, the three mode checks of _torch._plain_eager that are C
 * functions, torch._C._increment_version. */
static struct {
    PyObject *tensor_type, *f32, *empty_like, *mode_checks[3], *incver;
    PyObject *s_requires_grad, *s_dtype, *kwnames;
} fq_hot;

PyDoc_STRVAR(fq_recurrent_hot_init_doc,
"recurrent_hot_init(Tensor, float32, empty_like, functorch_active, len_dispatch_stack,\n"
"                   len_function_stack, increment_version) -> None\n\n"
"Gives recurrent_hot torch's objects (flashqla._torch calls it once, where\n"
"torch has the DLPack C exchange API).");

static PyObject *fq_recurrent_hot_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "recurrent_hot_init() takes 7 arguments (%zd given)", nargs);
    if (!PyType_Check(args[0])) return PyErr_Format(PyExc_TypeError, "recurrent_hot_init: expected a type first");
    for (int i = 2; i < 7; i++)
        if (!PyCallable_Check(args[i]))
            return PyErr_Format(PyExc_TypeError, "recurrent_hot_init: argument %d is not callable", i + 1);
    if (!fq_hot.kwnames) {
        /* the keywords recurrent_hot passes to recurrent, as its parser's interned names
         * (matched by pointer), found by name */
        static const char *const kw[] = {"scale", "state_indices", "use_qk_l2norm", "intermediate_states",
                                         "update_state", "state_layout", "exchange_api"};
        PyObject *t = PyTuple_New(7);
        if (!t) return NULL;
        for (int i = 0; i < 7; i++) {
            int j = 0;
            while (j < fq_recurrent_args.n && strcmp(fq_recurrent_names[j], kw[i]) != 0) j++;
            PyTuple_SET_ITEM(t, i, Py_NewRef(fq_recurrent_args.interned[j])); /* (every name is there) */
        }
        PyObject *a = PyUnicode_InternFromString("requires_grad"), *b = PyUnicode_InternFromString("dtype");
        if (!a || !b) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_DECREF(t);
            return NULL;
        }
        fq_hot.s_requires_grad = a, fq_hot.s_dtype = b, fq_hot.kwnames = t;
    }
    Py_XSETREF(fq_hot.tensor_type, Py_NewRef(args[0]));
    Py_XSETREF(fq_hot.f32, Py_NewRef(args[1]));
    Py_XSETREF(fq_hot.empty_like, Py_NewRef(args[2]));
    for (int i = 0; i < 3; i++) Py_XSETREF(fq_hot.mode_checks[i], Py_NewRef(args[3 + i]));
    Py_XSETREF(fq_hot.incver, Py_NewRef(args[6]));
    Py_RETURN_NONE;
}

/* 1 / 0 for the truth of r (a new reference, released), -1 with an error set
 * (also when r is NULL). */
static int fq_hot_truth(PyObject *r)
{
    if (!r) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

PyDoc_STRVAR(fq_recurrent_hot_doc,
"recurrent_hot(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm,\n"
"              intermediate_states, update_state, state_layout) -> o or None\n\n"
"flashqla._torch.recurrent_hot in C, for a torch with the DLPack C exchange\n"
"API (recurrent_hot_init first; the caller checks torch.compiler.is_compiling,\n"
"which torch.compile must see): when every tensor is a plain torch.Tensor that\n"
"does not require grad, no functorch transform, dispatch or function mode is\n"
"active, g and beta share a dtype (float32 or q's), the indices are a tensor\n"
"(on another device than q the binding refuses them), intermediate_states\n"
"(if any) a plain tensor, update_state a bool, state_layout \"kv\" or \"vk\"\n"
"and scale None or a float, it allocates o = torch.empty_like(v), runs\n"
"recurrent(..., exchange_api=True), bumps the autograd version of what it\n"
"wrote and returns o; None when the call is not\n"
"of that kind or the binding refused an argument (ValueError, TypeError):\n"
"the caller then takes the checked path, which raises its own errors.");

static PyObject *fq_recurrent_hot(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12)
        return PyErr_Format(PyExc_TypeError, "recurrent_hot() takes 12 positional arguments (%zd given)", nargs);
    if (!fq_hot.tensor_type) Py_RETURN_NONE;
    PyObject *q = args[0], *v = args[2], *g = args[3], *beta = args[4], *state = args[5], *idx = args[6];
    PyObject *scale = args[7], *l2 = args[8], *inter = args[9], *update = args[10], *layout = args[11];
    const PyTypeObject *T = (const PyTypeObject *)fq_hot.tensor_type;
    /* q, k, v, g, beta, state: plain tensors (exact type: no subclass, no FakeTensor) */
    for (int i = 0; i < 6; i++)
        if (Py_TYPE(args[i]) != T) Py_RETURN_NONE;
    /* nothing traces the call: no functorch transform, no dispatch or function mode */
    for (int i = 0; i < 3; i++) {
        const int t = fq_hot_truth(PyObject_CallNoArgs(fq_hot.mode_checks[i]));
        if (t < 0) return NULL;
        if (t) Py_RETURN_NONE;
    }
    for (int i = 0; i < 6; i++) {
        const int t = fq_hot_truth(PyObject_GetAttr(args[i], fq_hot.s_requires_grad));
        if (t < 0) return NULL;
        if (t) Py_RETURN_NONE;
    }
    /* g, beta: one dtype, float32 or q's (dtypes are singletons) */
    PyObject *gd = PyObject_GetAttr(g, fq_hot.s_dtype), *bd = gd ? PyObject_GetAttr(beta, fq_hot.s_dtype) : NULL;
    PyObject *qd = bd ? PyObject_GetAttr(q, fq_hot.s_dtype) : NULL;
    const int dtypes_ok = qd && gd == bd && (gd == fq_hot.f32 || gd == qd);
    Py_XDECREF(gd);
    Py_XDECREF(bd);
    Py_XDECREF(qd);
    if (!qd) return NULL;
    if (!dtypes_ok) Py_RETURN_NONE;
    /* indices: a plain tensor (on another device than q the binding refuses them: the
     * checked path then moves them) */
    if (idx != Py_None && Py_TYPE(idx) != T) Py_RETURN_NONE;
    /* verify or the [V, K] layout: update_state a bool, state_layout "kv" or "vk" (exact
     * str; anything else goes to the checked path), intermediate_states a plain tensor */
    const int is_str = PyUnicode_CheckExact(layout);
    const int kv = is_str && PyUnicode_CompareWithASCIIString(layout, "kv") == 0;
    const int vk = is_str && !kv && PyUnicode_CompareWithASCIIString(layout, "vk") == 0;
    if (!(kv || vk) || (update != Py_True && update != Py_False)) Py_RETURN_NONE;
    if (inter != Py_None) {
        if (Py_TYPE(inter) != T) Py_RETURN_NONE;
        const int t = fq_hot_truth(PyObject_GetAttr(inter, fq_hot.s_requires_grad));
        if (t < 0) return NULL;
        if (t) Py_RETURN_NONE;
    }
    if (scale != Py_None && !PyFloat_CheckExact(scale)) Py_RETURN_NONE; /* (the checked path converts it) */
    PyObject *o = PyObject_CallOneArg(fq_hot.empty_like, v); /* [B, T, HV, V] */
    if (!o) return NULL;
    PyObject *argv[14] = {args[0], args[1], v, g, beta, state, o, scale, idx, l2, inter, update, layout, Py_True};
    PyObject *r = fq_recurrent(self, argv, 7, fq_hot.kwnames);
    if (!r) {
        /* refused before anything ran (a non-contiguous array, a bad argument) */
        const int refused = PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_TypeError);
        Py_DECREF(o);
        if (!refused) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_DECREF(r);
    /* the autograd versions of what was written in place (flashqla._torch._written) */
    if (inter == Py_None && update != Py_True) return o; /* nothing written */
    PyObject *w = inter == Py_None    ? PyTuple_Pack(1, state)
                  : update == Py_True ? PyTuple_Pack(2, state, inter)
                                      : PyTuple_Pack(1, inter);
    r = w ? PyObject_CallOneArg(fq_hot.incver, w) : NULL;
    Py_XDECREF(w);
    if (!r) {
        Py_DECREF(o);
        return NULL;
    }
    Py_DECREF(r);
    return o;
}

PyDoc_STRVAR(fq_commit_doc,
"commit(state, intermediate_states, num_accepted, *, state_indices=None,\n"
"       state_layout=\"kv\", stream=None, exchange_api=False) -> None\n\n"
"After a verify step: state[state_indices[n]] = intermediate_states[n,\n"
"num_accepted[n] - 1] for every n with a slot >= 0 and num_accepted[n] > 0.\n"
"state [P,HV,K,V]; intermediate_states [N,Ti,HV,K,V]; num_accepted,\n"
"state_indices [N] int32/int64. exchange_api as for recurrent (the stream\n"
"then from state's producer).");

static const char *const fq_commit_names[] = {"state", "intermediate_states", "num_accepted", "state_indices",
                                              "state_layout", "stream", "exchange_api", NULL};
static fq_fastargs fq_commit_args = {"commit", fq_commit_names, 3, 7, NULL};

static PyObject *fq_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    enum { A_STATE, A_INTER, A_ACC, A_IDX, A_LAYOUT, A_STREAM, A_EXCHANGE, A_N };
    PyObject *a[A_N];
    PyObject *result = NULL;
    int exchange = 0;
    (void)self;
    if (fq_fastargs_parse(&fq_commit_args, args, nargsf, kwnames, a) < 0) return NULL;
    if (fq_bool_arg(a[A_EXCHANGE], &exchange) < 0) return NULL;
    PyObject *state = a[A_STATE], *inter = a[A_INTER], *acc = a[A_ACC], *idx = a[A_IDX];
    PyObject *layout = a[A_LAYOUT], *stream = a[A_STREAM];
    /* the pool first (it gives the device, HV, K, V), then the buffer (N, Ti) */
    enum { STATE, INTER, IDX, ACC, NSLOT };
    fq_slot slots[NSLOT] = {
        {"state", FQ_POOL, 1, 1, state, {0}},
        {"intermediate_states", FQ_INTER, 0, 1, inter, {0}},
        {"state_indices", FQ_IDX, 0, 0, idx, {0}},
        {"num_accepted", FQ_ACC, 0, 1, acc, {0}},
    };
    fq_call c = {.slots = slots, .n = NSLOT, .exchange = exchange};
    c.dtype = FQ_F64; /* no q: float64 states are allowed (the CPU backend) */
    fq_gdn_params p;
    if (fq_parse_layout(layout, &c.vk) < 0) return NULL;
    if (fq_call_validate(&c, stream) < 0) goto fail;
    fq_call_params(&c, &p, 1.0, 0, 0);
    p.state = slots[STATE].a.data;
    p.intermediate_states = slots[INTER].a.data;
    p.state_indices = slots[IDX].a.data;
    p.num_accepted = slots[ACC].a.data;
    if (fq_dispatch('c', &p, &c, NULL) < 0) goto fail;
    result = Py_NewRef(Py_None);
fail:
    fq_call_release(&c);
    return result;
}

/* ============================================================ utilities == */

static int fq_dtype_from_name(const char *s, fq_dtype *out)
{
    static const char *names[] = {"float32", "float16", "bfloat16", "float64"};
    static const fq_dtype codes[] = {FQ_F32, FQ_F16, FQ_BF16, FQ_F64};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = codes[i];
            return 1;
        }
    return 0;
}

PyDoc_STRVAR(fq_workspace_bytes_doc,
"workspace_bytes(op, B, T, H, HV, K, V, N, dtype, *, use_gate_in_kernel=False,\n"
"                use_beta_sigmoid_in_kernel=False) -> int\n\n"
"Bytes of CUDA scratch the call needs in its `workspace` argument; op is\n"
"\"fwd\", \"bwd\" or \"recurrent\", dtype \"float32\", \"float16\", \"bfloat16\"\n"
"or \"float64\"; the gate flags as the call will pass them (fused gates take\n"
"a region of their own). 0 when CUDA is not built. \"recurrent\": what a call\n"
"with cu_seqlens needs; one without takes workspace=None.");

static PyObject *fq_workspace_bytes(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"op", "B", "T", "H", "HV", "K", "V", "N", "dtype",
                             "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", NULL};
    PyObject *obj[9] = {NULL};
    int use_gate = 0, use_sig = 0;
    const char *op = NULL, *dtype = NULL;
    long long sz[7];
    fq_gdn_params p;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOO|$pp:workspace_bytes", kwlist, &obj[0], &obj[1],
                                     &obj[2], &obj[3], &obj[4], &obj[5], &obj[6], &obj[7], &obj[8], &use_gate,
                                     &use_sig))
        return NULL;
    if (!PyUnicode_Check(obj[0])) {
        PyErr_Format(PyExc_TypeError, "op: expected \"fwd\", \"bwd\" or \"recurrent\", got %.200s",
                     Py_TYPE(obj[0])->tp_name);
        return NULL;
    }
    if (!PyUnicode_Check(obj[8])) {
        PyErr_Format(PyExc_TypeError, "dtype: expected a dtype name such as \"float32\", got %.200s",
                     Py_TYPE(obj[8])->tp_name);
        return NULL;
    }
    if (!(op = PyUnicode_AsUTF8(obj[0])) || !(dtype = PyUnicode_AsUTF8(obj[8]))) return NULL;
    for (int i = 0; i < 7; i++)
        if (fq_int_arg(obj[i + 1], kwlist[i + 1], 0, INT64_MAX / 16, "a size >= 0 (an int)", &sz[i]) < 0)
            return NULL;
    const long long B = sz[0], T = sz[1], H = sz[2], HV = sz[3], K = sz[4], V = sz[5], N = sz[6];
    fq_params_init(&p);
    if (!fq_dtype_from_name(dtype, &p.dtype)) {
        PyErr_Format(PyExc_TypeError,
                     "dtype: expected \"float32\", \"float16\", \"bfloat16\" or \"float64\", got \"%s\"", dtype);
        return NULL;
    }
    if (B < 1 || T < 0 || H < 1 || HV < 1 || K < 1 || V < 1 || N < 0) {
        PyErr_Format(PyExc_ValueError,
                     "workspace_bytes: expected B, H, HV, K, V >= 1 and T, N >= 0, got B=%lld T=%lld "
                     "H=%lld HV=%lld K=%lld V=%lld N=%lld",
                     B, T, H, HV, K, V, N);
        return NULL;
    }
    p.B = B;
    p.T = T;
    p.H = H;
    p.HV = HV;
    p.K = K;
    p.V = V;
    p.N = N;
    p.P = N;
    p.state_dtype = p.dtype == FQ_F64 ? FQ_F64 : FQ_F32;
    p.use_gate_in_kernel = use_gate;
    p.use_beta_sigmoid_in_kernel = use_sig;
    size_t bytes;
    if (strcmp(op, "fwd") == 0) bytes = fq_cuda_chunk_fwd_workspace_bytes(&p);
    else if (strcmp(op, "bwd") == 0) bytes = fq_cuda_chunk_bwd_workspace_bytes(&p);
    else if (strcmp(op, "recurrent") == 0) bytes = fq_cuda_recurrent_workspace_bytes(&p);
    else {
        PyErr_Format(PyExc_ValueError, "op: expected \"fwd\", \"bwd\" or \"recurrent\", got \"%s\"", op);
        return NULL;
    }
    return PyLong_FromSize_t(bytes);
}

static PyObject *fq_cuda_built_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(fq_cuda_built());
}

static PyObject *fq_cpu_isa_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    const char *name = NULL;
    fq_status st = fq_cpu_isa(&name);
    if (st != FQ_OK) {
        fq_raise_status(st);
        return NULL;
    }
    return PyUnicode_FromString(name);
}

static PyObject *fq_default_threads(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(fq_cpu_default_threads());
}

PyDoc_STRVAR(fq_xla_ffi_targets_doc,
"xla_ffi_targets() -> list of (name, platform, capsule)\n\n"
"The XLA FFI handlers of this build (csrc/xla/gdn_xla.h), each a PyCapsule\n"
"of an XLA_FFI_Handler pointer for jax.ffi.register_ffi_target(name, capsule,\n"
"platform=platform). Empty when the build had no XLA FFI header.");

static PyObject *fq_xla_ffi_targets(PyObject *self, PyObject *unused)
{
    PyObject *list = NULL, *capsule = NULL, *item = NULL;
    int n = 0;
    (void)self;
    (void)unused;
    const fq_xla_target *t = fq_xla_targets(&n);
    list = PyList_New(0);
    if (!list) goto fail;
    for (int i = 0; i < n; i++) {
        capsule = PyCapsule_New(t[i].handler, NULL, NULL); /* unnamed, as jax.ffi.pycapsule */
        if (!capsule) goto fail;
        item = Py_BuildValue("(ssO)", t[i].name, t[i].platform, capsule);
        if (!item || PyList_Append(list, item) < 0) goto fail;
        Py_CLEAR(item);
        Py_CLEAR(capsule);
    }
    return list;
fail:
    Py_XDECREF(item);
    Py_XDECREF(capsule);
    Py_XDECREF(list);
    return NULL;
}

static PyObject *fq_xla_ffi_api_version(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(fq_xla_api_version());
}

/* ================================================================ module == */

static PyMethodDef fq_methods[] = {
    {"chunk_fwd", (PyCFunction)(void (*)(void))fq_chunk_fwd, METH_VARARGS | METH_KEYWORDS, fq_chunk_fwd_doc},
    {"chunk_bwd", (PyCFunction)(void (*)(void))fq_chunk_bwd, METH_VARARGS | METH_KEYWORDS, fq_chunk_bwd_doc},
    {"recurrent", (PyCFunction)(void (*)(void))fq_recurrent, METH_FASTCALL | METH_KEYWORDS, fq_recurrent_doc},
    {"commit", (PyCFunction)(void (*)(void))fq_commit, METH_FASTCALL | METH_KEYWORDS, fq_commit_doc},
    {"recurrent_hot", (PyCFunction)(void (*)(void))fq_recurrent_hot, METH_FASTCALL, fq_recurrent_hot_doc},
    {"recurrent_hot_init", (PyCFunction)(void (*)(void))fq_recurrent_hot_init, METH_FASTCALL,
     fq_recurrent_hot_init_doc},
    {"workspace_bytes", (PyCFunction)(void (*)(void))fq_workspace_bytes, METH_VARARGS | METH_KEYWORDS,
     fq_workspace_bytes_doc},
    {"dlpack_info", fq_dlpack_info, METH_O,
     "dlpack_info(capsule) -> (device_type, device_id, dtype): what an unused DLPack capsule\n"
     "holds, read without taking it"},
    {"exchange_api", fq_exchange_api_py, METH_O,
     "exchange_api(type) -> bool: arrays of that type carry a DLPack C exchange API (DLPack 1.3,\n"
     "__dlpack_c_exchange_api__) that recurrent(..., exchange_api=True) takes them through"},
    {"cuda_built", fq_cuda_built_py, METH_NOARGS, "cuda_built() -> bool: was the CUDA backend compiled in"},
    {"cpu_isa", fq_cpu_isa_py, METH_NOARGS,
     "cpu_isa() -> str: the CPU kernel set in use (avx512, avx2, neon, scalar; FLASHQLA_CPU_ISA\n"
     "forces one); raises flashqla.Error / ValueError when the forced one cannot run here"},
    {"default_threads", fq_default_threads, METH_NOARGS,
     "default_threads() -> int: CPU threads used when num_threads=0 (FLASHQLA_NUM_THREADS or all cores)"},
    {"xla_ffi_targets", fq_xla_ffi_targets, METH_NOARGS, fq_xla_ffi_targets_doc},
    {"xla_ffi_api_version", fq_xla_ffi_api_version, METH_NOARGS,
     "xla_ffi_api_version() -> str: the XLA FFI C API version of the handlers (\"\" without)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fq_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "flashqla._C",
    .m_doc = "flashqla C core binding: Gated DeltaNet kernels over DLPack arrays.",
    .m_size = -1,
    .m_methods = fq_methods,
};

PyMODINIT_FUNC PyInit__C(void)
{
    PyObject *m = NULL;
    if (fq_fastargs_init(&fq_recurrent_args) < 0 || fq_fastargs_init(&fq_commit_args) < 0) return NULL;
    m = PyModule_Create(&fq_module);
    if (!m) return NULL;
    if (!fq_Error) {
        fq_Error = PyErr_NewExceptionWithDoc("flashqla._C.Error",
                                             "A CUDA or internal failure of the flashqla core.",
                                             PyExc_RuntimeError, NULL);
        if (!fq_Error) goto fail;
    }
    if (PyModule_AddObjectRef(m, "Error", fq_Error) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "DLPACK_MAJOR_VERSION", DLPACK_MAJOR_VERSION) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
