/*
 * module.c — flashqla._C, the CPython binding of the C core (gdn.h).
 *
 * With py_buffer.c, the only files of the library that include Python.h. They
 * own every Python object and every reference count; the core sees a filled
 * fq_gdn_params.
 *
 * One call, in order:
 *   1. import    every array argument as a DLPack tensor: an object with
 *                __dlpack__/__dlpack_device__ (asked for a versioned capsule,
 *                legacy on TypeError; CUDA arrays get stream=) or a raw
 *                capsule. A capsule taken is renamed used_* at once, so from
 *                then on its deleter is ours to call (fq_call_release).
 *   2. validate  in a fixed order, each message naming the argument:
 *                dtype, shape, device, contiguity, data pointer, read-only.
 *   3. dispatch  fill fq_gdn_params and call fq_cpu_* / fq_cuda_* with the
 *                GIL released; map a failed status to an exception.
 *   4. release   call every taken tensor's deleter (every path).
 *
 * _C.Buffer and _C.empty (memory owned by flashqla, exported through
 * __dlpack__, for frameworks that cannot hand out writable arrays such as JAX)
 * live in py_buffer.c; py_binding.h is what the two files share.
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
#include "py_binding.h"

#define FQ_IMPORT_MAX_NDIM 64    /* sanity limit on imported tensors           */

PyObject *fq_Error = NULL; /* flashqla._C.Error (RuntimeError) */

/* ============================================================ formatting == */

const char *fq_device_str(DLDevice d, char *buf, size_t n)
{
    if (d.device_type == kDLCPU)
        snprintf(buf, n, "cpu");
    else if (d.device_type == kDLCUDA)
        snprintf(buf, n, "cuda:%d", (int)d.device_id);
    else
        snprintf(buf, n, "DLPack device type %d (id %d)", (int)d.device_type, (int)d.device_id);
    return buf;
}

static const char *fq_dl_dtype_str(DLDataType t, char *buf, size_t n)
{
    const char *kind = NULL;
    switch (t.code) {
    case kDLInt: kind = "int"; break;
    case kDLUInt: kind = "uint"; break;
    case kDLFloat: kind = "float"; break;
    case kDLBfloat: kind = "bfloat"; break;
    case kDLComplex: kind = "complex"; break;
    case kDLBool: kind = "bool"; break;
    default: break;
    }
    int w;
    if (!kind)
        w = snprintf(buf, n, "DLPack type code %u with %u bits", (unsigned)t.code, (unsigned)t.bits);
    else if (t.code == kDLBool && t.bits == 8)
        w = snprintf(buf, n, "bool");
    else
        w = snprintf(buf, n, "%s%u", kind, (unsigned)t.bits);
    if (t.lanes != 1 && w > 0 && (size_t)w < n)
        snprintf(buf + w, n - (size_t)w, "x%u", (unsigned)t.lanes);
    return buf;
}

/* "[2, 100, 4, 64]"; long shapes end in ", ...]". */
const char *fq_dims_str(int ndim, const int64_t *dims, char *buf, size_t n)
{
    size_t len = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim; i++) {
        if (len + 32 >= n) {
            snprintf(buf + len, n - len, "%s...", i ? ", " : "");
            len = strlen(buf);
            break;
        }
        len += (size_t)snprintf(buf + len, n - len, "%s%lld", i ? ", " : "", (long long)dims[i]);
    }
    snprintf(buf + len, n - len, "]");
    return buf;
}

/* ================================================================ dtypes == */

static int fq_float_dtype(DLDataType t, fq_dtype *out)
{
    if (t.lanes != 1) return 0;
    if (t.code == kDLFloat && t.bits == 32) *out = FQ_F32;
    else if (t.code == kDLFloat && t.bits == 16) *out = FQ_F16;
    else if (t.code == kDLBfloat && t.bits == 16) *out = FQ_BF16;
    else if (t.code == kDLFloat && t.bits == 64) *out = FQ_F64;
    else return 0;
    return 1;
}

static int fq_is_int_dtype(DLDataType t, int *is_int64)
{
    if (t.lanes != 1 || t.code != kDLInt || (t.bits != 32 && t.bits != 64)) return 0;
    *is_int64 = t.bits == 64;
    return 1;
}

/* ============================================================ exceptions == */

/* Raises the exception for a failed core status, with the core's message. */
void fq_raise_status(fq_status st)
{
    const char *msg = fq_last_error();
    if (!msg || !*msg) msg = "flashqla: the C core failed without a message";
    PyObject *type = fq_Error;
    if (st == FQ_ERR_VALUE) type = PyExc_ValueError;
    else if (st == FQ_ERR_TYPE) type = PyExc_TypeError;
    else if (st == FQ_ERR_NOMEM) type = PyExc_MemoryError;
    PyErr_SetString(type, msg);
}

/* The pending exception as one object (NULL if none), and back: PyErr_Fetch
 * is deprecated from Python 3.12 on. */
static PyObject *fq_error_take(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    PyErr_Fetch(&type, &value, &tb);
    if (!type) return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static void fq_error_give(PyObject *exc) /* steals exc; NULL: nothing */
{
    if (!exc) return;
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* Re-raises the pending exception of a producer's __dlpack__ with the
 * argument's name in front (same type, original chained as __cause__), for
 * the plain builtin exception types; anything else passes through as is. */
static void fq_prefix_error(const char *name, const char *what)
{
    PyObject *exc = fq_error_take(), *text = NULL, *renamed = NULL;
    PyObject *type = exc ? (PyObject *)Py_TYPE(exc) : NULL;
    if (type != PyExc_TypeError && type != PyExc_ValueError && type != PyExc_BufferError &&
        type != PyExc_RuntimeError) {
        fq_error_give(exc);
        return;
    }
    text = PyObject_Str(exc);
    if (!text) {
        PyErr_Clear();
        fq_error_give(exc);
        return;
    }
    PyErr_Format(type, "%s: %s: %U", name, what, text);
    Py_DECREF(text);
    renamed = fq_error_take();
    if (renamed) PyException_SetCause(renamed, exc); /* steals exc */
    else Py_DECREF(exc);
    fq_error_give(renamed);
}

/* ============================================================ DLPack in == */

/* An array argument once imported. */
typedef struct {
    PyObject *capsule;                   /* owned; already renamed used_*     */
    DLManagedTensor *legacy;             /* the taken tensor: one of the two  */
    DLManagedTensorVersioned *versioned;
    DLTensor *t;                         /* inside legacy or versioned        */
    int readonly;                        /* versioned flag READ_ONLY          */
    int64_t numel;                       /* set by the shape stage            */
    void *data;                          /* t->data + byte_offset (data stage) */
} fq_array;

/* Calls the deleter of a taken tensor (with the GIL held) and drops the
 * capsule. Safe on an empty fq_array. */
static void fq_array_release(fq_array *a)
{
    if (a->versioned) {
        if (a->versioned->deleter) a->versioned->deleter(a->versioned);
    } else if (a->legacy) {
        if (a->legacy->deleter) a->legacy->deleter(a->legacy);
    }
    Py_CLEAR(a->capsule);
    memset(a, 0, sizeof *a);
}

/* Takes ownership of the tensor in `capsule` (borrowed): renames the capsule
 * used_* and keeps a reference. From the rename on, fq_array_release must
 * run, also when this function fails afterwards (unsupported version/device). */
static int fq_array_take_capsule(fq_array *a, PyObject *capsule, const char *name)
{
    if (PyCapsule_IsValid(capsule, DLPACK_VERSIONED_TENSOR_UNUSED_NAME)) {
        DLManagedTensorVersioned *m =
            (DLManagedTensorVersioned *)PyCapsule_GetPointer(capsule, DLPACK_VERSIONED_TENSOR_UNUSED_NAME);
        if (!m) return -1;
        if (PyCapsule_SetName(capsule, DLPACK_VERSIONED_TENSOR_USED_NAME) < 0) return -1;
        a->capsule = Py_NewRef(capsule);
        a->versioned = m;
        if (m->version.major != DLPACK_MAJOR_VERSION) {
            /* Only version/manager_ctx/deleter may be read: the deleter runs
             * in fq_array_release, as the spec asks. */
            PyErr_Format(PyExc_ValueError,
                         "%s: DLPack version %u.%u is not supported (flashqla reads major version %d)",
                         name, (unsigned)m->version.major, (unsigned)m->version.minor,
                         DLPACK_MAJOR_VERSION);
            return -1;
        }
        a->t = &m->dl_tensor;
        a->readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    } else if (PyCapsule_IsValid(capsule, DLPACK_TENSOR_UNUSED_NAME)) {
        DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(capsule, DLPACK_TENSOR_UNUSED_NAME);
        if (!m) return -1;
        if (PyCapsule_SetName(capsule, DLPACK_TENSOR_USED_NAME) < 0) return -1;
        a->capsule = Py_NewRef(capsule);
        a->legacy = m;
        a->t = &m->dl_tensor;
        a->readonly = 0; /* legacy DLPack cannot say; producers refuse read-only */
    } else {
        const char *cname = PyCapsule_GetName(capsule);
        if (!cname) PyErr_Clear();
        if (cname && (strcmp(cname, DLPACK_TENSOR_USED_NAME) == 0 ||
                      strcmp(cname, DLPACK_VERSIONED_TENSOR_USED_NAME) == 0))
            PyErr_Format(PyExc_ValueError,
                         "%s: this DLPack capsule was already consumed (a capsule can be used once)",
                         name);
        else
            PyErr_Format(PyExc_TypeError,
                         "%s: expected a DLPack capsule named \"dltensor\" or \"dltensor_versioned\", "
                         "got one named \"%s\"",
                         name, cname ? cname : "(null)");
        return -1;
    }
    DLDeviceType dt = a->t->device.device_type;
    if (dt != kDLCPU && dt != kDLCUDA) {
        char dev[64];
        PyErr_Format(PyExc_ValueError, "%s: arrays on %s are not supported (only CPU and CUDA)",
                     name, fq_device_str(a->t->device, dev, sizeof dev));
        return -1;
    }
    return 0;
}

/* Imports one array argument. `cuda_stream` (borrowed) is passed as
 * __dlpack__(stream=...) to CUDA arrays only. */
static int fq_array_import(fq_array *a, PyObject *obj, const char *name, PyObject *cuda_stream)
{
    PyObject *dev = NULL, *method = NULL, *kwargs = NULL, *empty = NULL, *version = NULL;
    PyObject *capsule = NULL;
    int rc = -1;

    if (PyCapsule_CheckExact(obj)) return fq_array_take_capsule(a, obj, name);

    if (!PyObject_HasAttrString(obj, "__dlpack__") ||
        !PyObject_HasAttrString(obj, "__dlpack_device__")) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected an array with __dlpack__ and __dlpack_device__ (NumPy, PyTorch, "
                     "JAX, CuPy) or a DLPack capsule, got %.200s",
                     name, Py_TYPE(obj)->tp_name);
        goto fail;
    }
    dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (!dev) {
        fq_prefix_error(name, "__dlpack_device__() failed");
        goto fail;
    }
    long device_type = -1;
    if (PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2) {
        device_type = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
        if (device_type == -1 && PyErr_Occurred()) PyErr_Clear();
    }
    if (device_type == -1) {
        PyErr_Format(PyExc_TypeError,
                     "%s: __dlpack_device__() must return (device_type, device_id), got %.200R",
                     name, dev);
        goto fail;
    }
    if (device_type != kDLCPU && device_type != kDLCUDA) {
        PyErr_Format(PyExc_ValueError,
                     "%s: arrays on DLPack device type %ld are not supported (only CPU = 1 and "
                     "CUDA = 2)",
                     name, device_type);
        goto fail;
    }

    method = PyObject_GetAttrString(obj, "__dlpack__");
    if (!method) goto fail;
    kwargs = PyDict_New();
    empty = PyTuple_New(0);
    version = Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, 0);
    if (!kwargs || !empty || !version) goto fail;
    if (device_type == kDLCUDA && PyDict_SetItemString(kwargs, "stream", cuda_stream) < 0) goto fail;
    if (PyDict_SetItemString(kwargs, "max_version", version) < 0) goto fail;
    capsule = PyObject_Call(method, empty, kwargs);
    if (!capsule && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* a producer older than DLPack 1.0 does not know max_version */
        PyErr_Clear();
        if (PyDict_DelItemString(kwargs, "max_version") < 0) goto fail;
        capsule = PyObject_Call(method, empty, kwargs);
    }
    if (!capsule) {
        fq_prefix_error(name, "__dlpack__() failed");
        goto fail;
    }
    if (!PyCapsule_CheckExact(capsule)) {
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__() returned %.200s, not a DLPack capsule", name,
                     Py_TYPE(capsule)->tp_name);
        goto fail;
    }
    rc = fq_array_take_capsule(a, capsule, name);

fail:
    Py_XDECREF(capsule);
    Py_XDECREF(version);
    Py_XDECREF(empty);
    Py_XDECREF(kwargs);
    Py_XDECREF(method);
    Py_XDECREF(dev);
    return rc;
}

/* ======================================================= validation ====== */

/* What an argument is, which fixes its dtype and shape rules. */
enum {
    FQ_QK,    /* [B, T, H, K], dtype of q; the first one is q itself    */
    FQ_V,     /* [B, T, HV, V], dtype of q; the first one is v          */
    FQ_GATE,  /* [B, T, HV], float32 or q's dtype; all alike            */
    FQ_SEQ,   /* cu_seqlens [N + 1], int32/int64 (B == 1)               */
    FQ_IDX,   /* state_indices [N], int32/int64                          */
    FQ_STATE, /* [N, HV, K, V] float32 (float64 with float64 inputs)    */
    FQ_POOL,  /* recurrent pool [P, HV, K, V], state dtype               */
    FQ_WS     /* workspace, uint8 CUDA scratch (ignored for CPU calls)  */
};

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
} fq_call;

/* Releases every imported argument; keeps a pending exception intact while
 * the producers' deleters run. */
static void fq_call_release(fq_call *c)
{
    PyObject *exc = fq_error_take();
    for (int i = 0; i < c->n; i++) fq_array_release(&c->slots[i].a);
    Py_CLEAR(c->dlpack_stream);
    fq_error_give(exc);
}

/* An int stream (anything with __index__) or None (0). */
static int fq_stream_value(PyObject *obj, unsigned long long *v)
{
    PyObject *index = NULL;
    *v = 0;
    if (!obj || obj == Py_None) return 0;
    if (!PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "stream: expected an int (a cudaStream_t, e.g. "
                     "torch.cuda.current_stream().cuda_stream) or None, got %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    index = PyNumber_Index(obj);
    if (!index) return -1;
    *v = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (*v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "stream: expected a non-negative cudaStream_t, got %R", obj);
        return -1;
    }
    return 0;
}

/* stream: None -> legacy default stream (NULL for the core, 1 for
 * producers); an int -> that cudaStream_t (0 is passed to producers as 1,
 * the legacy default stream, since DLPack reserves 0). */
static int fq_parse_stream(PyObject *obj, fq_call *c)
{
    unsigned long long v = 0;
    if (fq_stream_value(obj, &v) < 0) return -1;
    c->stream = (void *)(uintptr_t)v;
    c->dlpack_stream = PyLong_FromUnsignedLongLong(v == 0 ? 1 : v);
    return c->dlpack_stream ? 0 : -1;
}

/* Stage 1: import, in slot order. Nothing given for a required slot is a
 * TypeError; the workspace is not touched when q is on the CPU. */
static int fq_stage_import(fq_call *c)
{
    for (int i = 0; i < c->n; i++) {
        fq_slot *s = &c->slots[i];
        if (!s->obj || s->obj == Py_None) {
            if (s->required) {
                PyErr_Format(PyExc_TypeError,
                             "%s: expected an array (an object with __dlpack__, or a DLPack capsule), "
                             "got None",
                             s->name);
                return -1;
            }
            continue;
        }
        if (s->kind == FQ_WS && c->slots[0].a.t->device.device_type != kDLCUDA) continue;
        if (fq_array_import(&s->a, s->obj, s->name, c->dlpack_stream) < 0) return -1;
    }
    return 0;
}

/* Stage 2: dtypes. */
static int fq_stage_dtype(fq_call *c)
{
    char got[64];
    int have_gate = 0, have_state = 0;
    const char *gate_first = NULL, *state_first = NULL;
    for (int i = 0; i < c->n; i++) {
        fq_slot *s = &c->slots[i];
        if (!s->a.t) continue;
        DLDataType t = s->a.t->dtype;
        fq_dtype d;
        fq_dl_dtype_str(t, got, sizeof got);
        switch (s->kind) {
        case FQ_QK:
        case FQ_V:
            if (i == 0) {
                if (!fq_float_dtype(t, &c->dtype)) {
                    PyErr_Format(PyExc_TypeError,
                                 "%s: expected dtype float32, float16, bfloat16 or float64, got %s",
                                 s->name, got);
                    return -1;
                }
            } else if (!fq_float_dtype(t, &d) || d != c->dtype) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype %s like %s, got %s", s->name,
                             fq_dtype_name(c->dtype), c->slots[0].name, got);
                return -1;
            }
            break;
        case FQ_GATE:
            if (!have_gate) {
                if (!fq_float_dtype(t, &d) || (d != FQ_F32 && d != c->dtype)) {
                    if (c->dtype == FQ_F32)
                        PyErr_Format(PyExc_TypeError, "%s: expected dtype float32, got %s", s->name, got);
                    else
                        PyErr_Format(PyExc_TypeError, "%s: expected dtype float32 or %s (like %s), got %s",
                                     s->name, fq_dtype_name(c->dtype), c->slots[0].name, got);
                    return -1;
                }
                c->gate_dtype = d;
                have_gate = 1;
                gate_first = s->name;
            } else if (!fq_float_dtype(t, &d) || d != c->gate_dtype) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype %s like %s, got %s", s->name,
                             fq_dtype_name(c->gate_dtype), gate_first, got);
                return -1;
            }
            break;
        case FQ_STATE:
        case FQ_POOL:
            if (!have_state) {
                int ok = fq_float_dtype(t, &d) && (d == FQ_F32 || (d == FQ_F64 && c->dtype == FQ_F64));
                if (!ok) {
                    if (c->dtype == FQ_F64)
                        PyErr_Format(PyExc_TypeError, "%s: expected dtype float32 or float64, got %s",
                                     s->name, got);
                    else
                        PyErr_Format(PyExc_TypeError,
                                     "%s: expected dtype float32 (states are float32; float64 only "
                                     "with float64 inputs), got %s",
                                     s->name, got);
                    return -1;
                }
                c->state_dtype = d;
                have_state = 1;
                state_first = s->name;
            } else if (!fq_float_dtype(t, &d) || d != c->state_dtype) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype %s like %s, got %s", s->name,
                             fq_dtype_name(c->state_dtype), state_first, got);
                return -1;
            }
            break;
        case FQ_SEQ:
        case FQ_IDX: {
            int is64 = 0;
            if (!fq_is_int_dtype(t, &is64)) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype int32 or int64, got %s", s->name, got);
                return -1;
            }
            if (s->kind == FQ_SEQ) c->seq_int64 = is64;
            else c->idx_int64 = is64;
            break;
        }
        case FQ_WS:
            if (t.code != kDLUInt || t.bits != 8 || t.lanes != 1) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype uint8, got %s", s->name, got);
                return -1;
            }
            break;
        }
    }
    return 0;
}

/* The tensor is well formed: rank, dims >= 0, element and byte counts fit
 * in int64. Sets a->numel. */
static int fq_check_structure(fq_slot *s)
{
    const DLTensor *t = s->a.t;
    if (t->ndim < 0 || t->ndim > FQ_IMPORT_MAX_NDIM || (t->ndim > 0 && !t->shape)) {
        PyErr_Format(PyExc_ValueError, "%s: malformed DLPack tensor (ndim %d)", s->name, (int)t->ndim);
        return -1;
    }
    int64_t numel = 1;
    int overflow = 0, zero = 0;
    for (int i = 0; i < t->ndim; i++) {
        int64_t d = t->shape[i];
        if (d < 0) {
            PyErr_Format(PyExc_ValueError, "%s: malformed DLPack tensor (dimension %d is %lld)", s->name,
                         i, (long long)d);
            return -1;
        }
        if (d == 0) zero = 1;
        else if (numel > INT64_MAX / d) overflow = 1;
        else numel *= d;
    }
    if (zero) numel = 0, overflow = 0; /* an empty array has no size problem */
    size_t itemsize = ((size_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
    if (overflow || (itemsize && numel > (int64_t)(INT64_MAX / (int64_t)itemsize))) {
        char sh[160];
        PyErr_Format(PyExc_ValueError, "%s: shape %s is too large", s->name,
                     fq_dims_str(t->ndim, t->shape, sh, sizeof sh));
        return -1;
    }
    s->a.numel = numel;
    return 0;
}

static int fq_shape_is(const DLTensor *t, int ndim, const int64_t *dims)
{
    if (t->ndim != ndim) return 0;
    for (int i = 0; i < ndim; i++)
        if (t->shape[i] != dims[i]) return 0;
    return 1;
}

/* Stage 3: shapes. Slot order puts q, k, v, gates before cu_seqlens and
 * cu_seqlens/state_indices before the states, so every size used is known. */
static int fq_stage_shape(fq_call *c)
{
    char got[160], want[160];
    int have_v = 0, have_idx = 0;
    for (int i = 0; i < c->n; i++)
        if (c->slots[i].kind == FQ_IDX && c->slots[i].a.t) have_idx = 1;
    for (int i = 0; i < c->n; i++) {
        fq_slot *s = &c->slots[i];
        if (!s->a.t) continue;
        if (fq_check_structure(s) < 0) return -1;
        const DLTensor *t = s->a.t;
        fq_dims_str(t->ndim, t->shape, got, sizeof got);
        switch (s->kind) {
        case FQ_QK: {
            if (i == 0) {
                if (t->ndim != 4) {
                    PyErr_Format(PyExc_ValueError, "%s: expected a 4-d array [B, T, H, K], got shape %s",
                                 s->name, got);
                    return -1;
                }
                c->B = t->shape[0];
                c->T = t->shape[1];
                c->H = t->shape[2];
                c->K = t->shape[3];
                c->N = c->B;
                if (c->B < 1 || c->H < 1 || c->K < 1) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s: expected B >= 1, H >= 1 and K >= 1 in [B, T, H, K], got shape %s",
                                 s->name, got);
                    return -1;
                }
                break;
            }
            int64_t dims[4] = {c->B, c->T, c->H, c->K};
            if (!fq_shape_is(t, 4, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s like %s, got %s", s->name,
                             fq_dims_str(4, dims, want, sizeof want), c->slots[0].name, got);
                return -1;
            }
            break;
        }
        case FQ_V: {
            if (!have_v) {
                if (t->ndim != 4 || t->shape[0] != c->B || t->shape[1] != c->T) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s: expected shape [B=%lld, T=%lld, HV, V] (B, T of %s), got %s",
                                 s->name, (long long)c->B, (long long)c->T, c->slots[0].name, got);
                    return -1;
                }
                c->HV = t->shape[2];
                c->V = t->shape[3];
                if (c->HV < 1 || c->V < 1) {
                    PyErr_Format(PyExc_ValueError, "%s: expected HV >= 1 and V >= 1, got shape %s",
                                 s->name, got);
                    return -1;
                }
                if (c->HV % c->H != 0) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s: the value heads HV=%lld must be a multiple of the q/k heads H=%lld",
                                 s->name, (long long)c->HV, (long long)c->H);
                    return -1;
                }
                have_v = 1;
                break;
            }
            int64_t dims[4] = {c->B, c->T, c->HV, c->V};
            if (!fq_shape_is(t, 4, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s like v, got %s", s->name,
                             fq_dims_str(4, dims, want, sizeof want), got);
                return -1;
            }
            break;
        }
        case FQ_GATE: {
            int64_t dims[3] = {c->B, c->T, c->HV};
            if (!fq_shape_is(t, 3, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s ([B, T, HV]), got %s", s->name,
                             fq_dims_str(3, dims, want, sizeof want), got);
                return -1;
            }
            break;
        }
        case FQ_SEQ:
            if (t->ndim != 1 || t->shape[0] < 2) {
                PyErr_Format(PyExc_ValueError,
                             "%s: expected a 1-d array of N+1 >= 2 offsets, got shape %s", s->name, got);
                return -1;
            }
            if (c->B != 1) {
                PyErr_Format(PyExc_ValueError,
                             "%s: packed sequences need %s of batch size 1, got %lld", s->name,
                             c->slots[0].name, (long long)c->B);
                return -1;
            }
            c->N = t->shape[0] - 1;
            break;
        case FQ_IDX: {
            int64_t dims[1] = {c->N};
            if (!fq_shape_is(t, 1, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s ([N], one slot per sequence), got %s",
                             s->name, fq_dims_str(1, dims, want, sizeof want), got);
                return -1;
            }
            break;
        }
        case FQ_STATE: {
            int64_t dims[4] = {c->N, c->HV, c->K, c->V};
            if (!fq_shape_is(t, 4, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s ([N, HV, K, V]), got %s", s->name,
                             fq_dims_str(4, dims, want, sizeof want), got);
                return -1;
            }
            break;
        }
        case FQ_POOL:
            if (t->ndim != 4 || t->shape[0] < 1 || t->shape[1] != c->HV || t->shape[2] != c->K ||
                t->shape[3] != c->V) {
                PyErr_Format(PyExc_ValueError,
                             "%s: expected shape [P, %lld, %lld, %lld] ([P, HV, K, V], P >= 1), got %s",
                             s->name, (long long)c->HV, (long long)c->K, (long long)c->V, got);
                return -1;
            }
            c->P = t->shape[0];
            if (!have_idx && c->P != c->N) {
                PyErr_Format(PyExc_ValueError,
                             "%s: without state_indices the pool must have N=%lld slots, got shape %s",
                             s->name, (long long)c->N, got);
                return -1;
            }
            break;
        case FQ_WS:
            break; /* any shape: its byte count is checked at dispatch */
        }
    }
    return 0;
}

/* Stages 4-7: device, contiguity, data pointer, read-only. */
static int fq_stage_memory(fq_call *c)
{
    char dev[64], qdev[64];
    c->device = c->slots[0].a.t->device;
    for (int i = 1; i < c->n; i++) { /* 4: one device */
        fq_slot *s = &c->slots[i];
        if (!s->a.t) continue;
        DLDevice d = s->a.t->device;
        if (d.device_type != c->device.device_type ||
            (d.device_type == kDLCUDA && d.device_id != c->device.device_id)) {
            PyErr_Format(PyExc_ValueError, "%s: on %s but %s is on %s", s->name,
                         fq_device_str(d, dev, sizeof dev), c->slots[0].name,
                         fq_device_str(c->device, qdev, sizeof qdev));
            return -1;
        }
    }
    for (int i = 0; i < c->n; i++) { /* 5: C-contiguous (size-1 dims free) */
        fq_slot *s = &c->slots[i];
        const DLTensor *t = s->a.t;
        if (!t || !t->strides || s->a.numel == 0) continue;
        int64_t expect = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != expect) {
                PyErr_Format(PyExc_ValueError, "%s: must be C-contiguous (call .contiguous())", s->name);
                return -1;
            }
            expect *= t->shape[d];
        }
    }
    for (int i = 0; i < c->n; i++) { /* 6: data pointer, byte_offset, alignment */
        fq_slot *s = &c->slots[i];
        const DLTensor *t = s->a.t;
        if (!t) continue;
        if (!t->data && s->a.numel > 0) {
            PyErr_Format(PyExc_ValueError, "%s: has a NULL data pointer", s->name);
            return -1;
        }
        s->a.data = t->data ? (void *)((char *)t->data + t->byte_offset) : NULL;
        size_t itemsize = ((size_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
        if (itemsize > 1 && ((uintptr_t)s->a.data % itemsize) != 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: data is not aligned to its %zu-byte elements (byte_offset %llu)", s->name,
                         itemsize, (unsigned long long)t->byte_offset);
            return -1;
        }
    }
    for (int i = 0; i < c->n; i++) { /* 7: outputs writable */
        fq_slot *s = &c->slots[i];
        if (s->a.t && s->writable && s->a.readonly) {
            PyErr_Format(PyExc_ValueError, "%s: is read-only, but flashqla writes it (pass a writable array)",
                         s->name);
            return -1;
        }
    }
    return 0;
}

/* All stages; on failure the caller still runs fq_call_release. */
static int fq_call_validate(fq_call *c, PyObject *stream)
{
    if (fq_parse_stream(stream, c) < 0) return -1;
    if (fq_stage_import(c) < 0) return -1;
    if (fq_stage_dtype(c) < 0) return -1;
    if (fq_stage_shape(c) < 0) return -1;
    if (fq_stage_memory(c) < 0) return -1;
    return 0;
}

/* scale is a required keyword; None means the usual K^-1/2 (*use_default),
 * resolved once K is known. Checked before any array is imported. */
static int fq_parse_scale(PyObject *obj, const char *fn, double *scale, int *use_default)
{
    *use_default = 0;
    if (!obj) {
        PyErr_Format(PyExc_TypeError, "%s() missing required keyword-only argument: 'scale'", fn);
        return -1;
    }
    if (obj == Py_None) {
        *use_default = 1;
        return 0;
    }
    *scale = PyFloat_AsDouble(obj);
    if (*scale == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "scale: expected a float, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* Sizes, dtypes and options common to every op. */
static void fq_call_params(const fq_call *c, fq_gdn_params *p, double scale, int use_qk_l2norm,
                           int num_threads)
{
    fq_params_init(p);
    p->B = c->B;
    p->T = c->T;
    p->H = c->H;
    p->HV = c->HV;
    p->K = c->K;
    p->V = c->V;
    p->N = c->N;
    p->P = c->P;
    p->dtype = c->dtype;
    p->gate_dtype = c->gate_dtype;
    p->state_dtype = c->state_dtype;
    p->scale = scale;
    p->use_qk_l2norm = use_qk_l2norm;
    p->cu_seqlens_is_int64 = c->seq_int64;
    p->state_indices_is_int64 = c->idx_int64;
    p->num_threads = num_threads;
    p->stream = c->stream;
    p->device = c->device.device_type == kDLCUDA ? (int)c->device.device_id : 0;
}

/* Runs op 'f', 'b' or 'r' on q's device with the GIL released. `ws` is the
 * workspace slot (imported only for CUDA calls). */
static int fq_dispatch(char op, fq_gdn_params *p, const fq_call *c, const fq_slot *ws)
{
    fq_status st;
    if (c->device.device_type == kDLCPU) {
        Py_BEGIN_ALLOW_THREADS
        st = op == 'f' ? fq_cpu_chunk_fwd(p) : op == 'b' ? fq_cpu_chunk_bwd(p) : fq_cpu_recurrent(p);
        Py_END_ALLOW_THREADS
    } else {
        size_t need = op == 'f'   ? fq_cuda_chunk_fwd_workspace_bytes(p)
                      : op == 'b' ? fq_cuda_chunk_bwd_workspace_bytes(p)
                                  : fq_cuda_recurrent_workspace_bytes(p);
        if (ws->a.t) {
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
        st = op == 'f' ? fq_cuda_chunk_fwd(p) : op == 'b' ? fq_cuda_chunk_bwd(p) : fq_cuda_recurrent(p);
        Py_END_ALLOW_THREADS
    }
    if (st != FQ_OK) {
        fq_raise_status(st);
        return -1;
    }
    return 0;
}

/* ================================================================ ops ====== */

PyDoc_STRVAR(fq_chunk_fwd_doc,
"chunk_fwd(q, k, v, g, beta, o, *, scale, initial_state=None, final_state=None,\n"
"          cu_seqlens=None, use_qk_l2norm=False, workspace=None, stream=None,\n"
"          num_threads=0) -> None\n\n"
"Chunked forward of the gated delta rule. Writes o [B,T,HV,V] and, if given,\n"
"final_state [N,HV,K,V] in place. q,k [B,T,H,K]; v [B,T,HV,V]; g,beta [B,T,HV];\n"
"initial_state [N,HV,K,V]; cu_seqlens [N+1] (B == 1). scale=None: K**-0.5.");

static PyObject *fq_chunk_fwd(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"q", "k", "v", "g", "beta", "o", "scale", "initial_state", "final_state",
                             "cu_seqlens", "use_qk_l2norm", "workspace", "stream", "num_threads", NULL};
    PyObject *q = NULL, *k = NULL, *v = NULL, *g = NULL, *beta = NULL, *o = NULL, *scale_obj = NULL;
    PyObject *h0 = NULL, *ht = NULL, *cu = NULL, *ws = NULL, *stream = NULL;
    PyObject *result = NULL;
    int l2 = 0, num_threads = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO|$OOOOpOOi:chunk_fwd", kwlist, &q, &k, &v, &g,
                                     &beta, &o, &scale_obj, &h0, &ht, &cu, &l2, &ws, &stream,
                                     &num_threads))
        return NULL;
    enum { Q, K, V, G, BETA, O, SEQ, H0, HT, WS, NSLOT };
    fq_slot slots[NSLOT] = {
        {"q", FQ_QK, 0, 1, q, {0}},          {"k", FQ_QK, 0, 1, k, {0}},
        {"v", FQ_V, 0, 1, v, {0}},           {"g", FQ_GATE, 0, 1, g, {0}},
        {"beta", FQ_GATE, 0, 1, beta, {0}},  {"o", FQ_V, 1, 1, o, {0}},
        {"cu_seqlens", FQ_SEQ, 0, 0, cu, {0}}, {"initial_state", FQ_STATE, 0, 0, h0, {0}},
        {"final_state", FQ_STATE, 1, 0, ht, {0}}, {"workspace", FQ_WS, 1, 0, ws, {0}},
    };
    fq_call c = {.slots = slots, .n = NSLOT};
    fq_gdn_params p;
    double scale = 0.0;
    int scale_default = 0;
    if (fq_parse_scale(scale_obj, "chunk_fwd", &scale, &scale_default) < 0) return NULL;
    if (fq_call_validate(&c, stream) < 0) goto fail;
    if (scale_default) scale = 1.0 / sqrt((double)c.K);
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
    if (fq_dispatch('f', &p, &c, &slots[WS]) < 0) goto fail;
    result = Py_NewRef(Py_None);
fail:
    fq_call_release(&c);
    return result;
}

PyDoc_STRVAR(fq_chunk_bwd_doc,
"chunk_bwd(q, k, v, g, beta, do, dq, dk, dv, dg, dbeta, *, scale,\n"
"          initial_state=None, dfinal_state=None, dinitial_state=None,\n"
"          cu_seqlens=None, use_qk_l2norm=False, workspace=None, stream=None,\n"
"          num_threads=0) -> None\n\n"
"Chunked backward: from do (and dfinal_state) writes dq, dk [B,T,H,K],\n"
"dv [B,T,HV,V], dg, dbeta [B,T,HV] and, when initial_state is given,\n"
"dinitial_state [N,HV,K,V] in place.");

static PyObject *fq_chunk_bwd(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"q", "k", "v", "g", "beta", "do", "dq", "dk", "dv", "dg", "dbeta", "scale",
                             "initial_state", "dfinal_state", "dinitial_state", "cu_seqlens",
                             "use_qk_l2norm", "workspace", "stream", "num_threads", NULL};
    PyObject *q = NULL, *k = NULL, *v = NULL, *g = NULL, *beta = NULL, *dout = NULL;
    PyObject *dq = NULL, *dk = NULL, *dv = NULL, *dg = NULL, *dbeta = NULL, *scale_obj = NULL;
    PyObject *h0 = NULL, *dht = NULL, *dh0 = NULL, *cu = NULL, *ws = NULL, *stream = NULL;
    PyObject *result = NULL;
    int l2 = 0, num_threads = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOOO|$OOOOOpOOi:chunk_bwd", kwlist, &q, &k, &v,
                                     &g, &beta, &dout, &dq, &dk, &dv, &dg, &dbeta, &scale_obj, &h0, &dht,
                                     &dh0, &cu, &l2, &ws, &stream, &num_threads))
        return NULL;
    enum { Q, K, V, G, BETA, DO, DQ, DK, DV, DG, DBETA, SEQ, H0, DHT, DH0, WS, NSLOT };
    fq_slot slots[NSLOT] = {
        {"q", FQ_QK, 0, 1, q, {0}},           {"k", FQ_QK, 0, 1, k, {0}},
        {"v", FQ_V, 0, 1, v, {0}},            {"g", FQ_GATE, 0, 1, g, {0}},
        {"beta", FQ_GATE, 0, 1, beta, {0}},   {"do", FQ_V, 0, 1, dout, {0}},
        {"dq", FQ_QK, 1, 1, dq, {0}},         {"dk", FQ_QK, 1, 1, dk, {0}},
        {"dv", FQ_V, 1, 1, dv, {0}},          {"dg", FQ_GATE, 1, 1, dg, {0}},
        {"dbeta", FQ_GATE, 1, 1, dbeta, {0}}, {"cu_seqlens", FQ_SEQ, 0, 0, cu, {0}},
        {"initial_state", FQ_STATE, 0, 0, h0, {0}}, {"dfinal_state", FQ_STATE, 0, 0, dht, {0}},
        {"dinitial_state", FQ_STATE, 1, 0, dh0, {0}}, {"workspace", FQ_WS, 1, 0, ws, {0}},
    };
    fq_call c = {.slots = slots, .n = NSLOT};
    fq_gdn_params p;
    double scale = 0.0;
    int scale_default = 0;
    if (fq_parse_scale(scale_obj, "chunk_bwd", &scale, &scale_default) < 0) return NULL;
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
    if (scale_default) scale = 1.0 / sqrt((double)c.K);
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
    if (fq_dispatch('b', &p, &c, &slots[WS]) < 0) goto fail;
    result = Py_NewRef(Py_None);
fail:
    fq_call_release(&c);
    return result;
}

PyDoc_STRVAR(fq_recurrent_doc,
"recurrent(q, k, v, g, beta, state, o, *, scale, state_indices=None,\n"
"          cu_seqlens=None, use_qk_l2norm=False, workspace=None, stream=None,\n"
"          num_threads=0) -> None\n\n"
"Recurrent steps (decoding): updates the state pool [P,HV,K,V] in place and\n"
"writes o. state_indices [N] picks each sequence's slot (< 0: padding).");

static PyObject *fq_recurrent(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"q", "k", "v", "g", "beta", "state", "o", "scale", "state_indices",
                             "cu_seqlens", "use_qk_l2norm", "workspace", "stream", "num_threads", NULL};
    PyObject *q = NULL, *k = NULL, *v = NULL, *g = NULL, *beta = NULL, *state = NULL, *o = NULL;
    PyObject *scale_obj = NULL, *idx = NULL, *cu = NULL, *ws = NULL, *stream = NULL;
    PyObject *result = NULL;
    int l2 = 0, num_threads = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO|$OOOpOOi:recurrent", kwlist, &q, &k, &v, &g,
                                     &beta, &state, &o, &scale_obj, &idx, &cu, &l2, &ws, &stream,
                                     &num_threads))
        return NULL;
    enum { Q, K, V, G, BETA, O, SEQ, IDX, STATE, WS, NSLOT };
    fq_slot slots[NSLOT] = {
        {"q", FQ_QK, 0, 1, q, {0}},         {"k", FQ_QK, 0, 1, k, {0}},
        {"v", FQ_V, 0, 1, v, {0}},          {"g", FQ_GATE, 0, 1, g, {0}},
        {"beta", FQ_GATE, 0, 1, beta, {0}}, {"o", FQ_V, 1, 1, o, {0}},
        {"cu_seqlens", FQ_SEQ, 0, 0, cu, {0}}, {"state_indices", FQ_IDX, 0, 0, idx, {0}},
        {"state", FQ_POOL, 1, 1, state, {0}}, {"workspace", FQ_WS, 1, 0, ws, {0}},
    };
    fq_call c = {.slots = slots, .n = NSLOT};
    fq_gdn_params p;
    double scale = 0.0;
    int scale_default = 0;
    if (fq_parse_scale(scale_obj, "recurrent", &scale, &scale_default) < 0) return NULL;
    if (fq_call_validate(&c, stream) < 0) goto fail;
    if (scale_default) scale = 1.0 / sqrt((double)c.K);
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
    if (fq_dispatch('r', &p, &c, &slots[WS]) < 0) goto fail;
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
"workspace_bytes(op, B, T, H, HV, K, V, N, dtype) -> int\n\n"
"Bytes of CUDA scratch the call needs in its `workspace` argument; op is\n"
"\"fwd\", \"bwd\" or \"recurrent\", dtype \"float32\", \"float16\", \"bfloat16\"\n"
"or \"float64\". 0 when CUDA is not built.");

static PyObject *fq_workspace_bytes(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"op", "B", "T", "H", "HV", "K", "V", "N", "dtype", NULL};
    const char *op = NULL, *dtype = NULL;
    long long B, T, H, HV, K, V, N;
    fq_gdn_params p;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sLLLLLLLs:workspace_bytes", kwlist, &op, &B, &T, &H, &HV,
                                     &K, &V, &N, &dtype))
        return NULL;
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

static PyObject *fq_default_threads(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(fq_cpu_default_threads());
}

PyDoc_STRVAR(fq_synchronize_doc,
"synchronize(device_id, stream=None) -> None\n\n"
"Waits for the work queued on `stream` (an int cudaStream_t; None: the legacy\n"
"default stream) of CUDA device `device_id`.");

static PyObject *fq_synchronize(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device_id", "stream", NULL};
    int device = 0;
    PyObject *stream_obj = Py_None;
    unsigned long long stream = 0;
    fq_status st;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|O:synchronize", kwlist, &device, &stream_obj))
        return NULL;
    if (fq_stream_value(stream_obj, &stream) < 0) return NULL;
    if (device < 0) {
        PyErr_Format(PyExc_ValueError, "device_id: expected >= 0, got %d", device);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    st = fq_cuda_synchronize_stream(device, (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    if (st != FQ_OK) {
        fq_raise_status(st);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ================================================================ module == */

static PyMethodDef fq_methods[] = {
    {"chunk_fwd", (PyCFunction)(void (*)(void))fq_chunk_fwd, METH_VARARGS | METH_KEYWORDS, fq_chunk_fwd_doc},
    {"chunk_bwd", (PyCFunction)(void (*)(void))fq_chunk_bwd, METH_VARARGS | METH_KEYWORDS, fq_chunk_bwd_doc},
    {"recurrent", (PyCFunction)(void (*)(void))fq_recurrent, METH_VARARGS | METH_KEYWORDS, fq_recurrent_doc},
    {"workspace_bytes", (PyCFunction)(void (*)(void))fq_workspace_bytes, METH_VARARGS | METH_KEYWORDS,
     fq_workspace_bytes_doc},
    {"cuda_built", fq_cuda_built_py, METH_NOARGS, "cuda_built() -> bool: was the CUDA backend compiled in"},
    {"default_threads", fq_default_threads, METH_NOARGS,
     "default_threads() -> int: CPU threads used when num_threads=0 (FLASHQLA_NUM_THREADS or all cores)"},
    {"synchronize", (PyCFunction)(void (*)(void))fq_synchronize, METH_VARARGS | METH_KEYWORDS,
     fq_synchronize_doc},
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
    m = PyModule_Create(&fq_module);
    if (!m) return NULL;
    if (!fq_Error) {
        fq_Error = PyErr_NewExceptionWithDoc("flashqla._C.Error",
                                             "A CUDA or internal failure of the flashqla core.",
                                             PyExc_RuntimeError, NULL);
        if (!fq_Error) goto fail;
    }
    if (PyModule_AddObjectRef(m, "Error", fq_Error) < 0) goto fail;
    if (fq_buffer_add_to_module(m) < 0) goto fail; /* _C.Buffer, _C.empty */
    if (PyModule_AddIntConstant(m, "DLPACK_MAJOR_VERSION", DLPACK_MAJOR_VERSION) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
