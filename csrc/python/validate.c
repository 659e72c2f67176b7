/*
 * validate.c — step 2 of a call: its array arguments (an fq_call of fq_slots)
 * imported in slot order and checked in a fixed order, each message naming
 * the argument: dtype, shape, device, contiguity, data pointer, read-only.
 * Then the sizes, dtypes and options go into an fq_gdn_params.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "gdn.h"
#include "errors.h"
#include "dlpack_import.h"
#include "validate.h"

#define FQ_IMPORT_MAX_NDIM 64    /* sanity limit on imported tensors           */

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
/* ======================================================= validation ====== */

/* Releases every imported argument; keeps a pending exception intact while
 * the producers' deleters run. */
void fq_call_release(fq_call *c)
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
 * TypeError; the workspace is not touched when q is on the CPU. In exchange
 * mode with no stream given (`producer_stream`), a first array taken through
 * the C exchange API on CUDA gives the call its stream (its producer's
 * current one), before any other array is asked for a capsule with it. */
static int fq_stage_import(fq_call *c, int producer_stream)
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
        if (fq_array_import(&s->a, s->obj, s->name, c->dlpack_stream, c->exchange, s->writable) < 0)
            return -1;
        if (i == 0 && producer_stream && s->a.xapi && s->a.t->device.device_type == kDLCUDA) {
            void *st = NULL;
            if (fq_current_work_stream(&s->a, &st) < 0) return -1;
            c->stream = st;
            Py_SETREF(c->dlpack_stream, PyLong_FromUnsignedLongLong(st ? (unsigned long long)(uintptr_t)st : 1));
            if (!c->dlpack_stream) return -1;
        }
    }
    return 0;
}

/* The dtype of the slot's tensor t as text: formatted only for a message
 * (a call that passes formats nothing). */
#define GOT fq_dl_dtype_str(t, got, sizeof got)

/* Stage 2: dtypes. */
static int fq_stage_dtype(fq_call *c)
{
    char got[64];
    int have_gate = 0, have_state = 0, have_param = 0;
    const char *gate_first = NULL, *state_first = NULL, *param_first = NULL;
    for (int i = 0; i < c->n; i++) {
        fq_slot *s = &c->slots[i];
        if (!s->a.t) continue;
        DLDataType t = s->a.t->dtype;
        fq_dtype d;
        switch (s->kind) {
        case FQ_QK:
        case FQ_V:
            if (i == 0) {
                if (!fq_float_dtype(t, &c->dtype)) {
                    PyErr_Format(PyExc_TypeError,
                                 "%s: expected dtype float32, float16, bfloat16 or float64, got %s",
                                 s->name, GOT);
                    return -1;
                }
            } else if (!fq_float_dtype(t, &d) || d != c->dtype) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype %s like %s, got %s", s->name,
                             fq_dtype_name(c->dtype), c->slots[0].name, GOT);
                return -1;
            }
            break;
        case FQ_GATE:
            if (!have_gate) {
                if (!fq_float_dtype(t, &d) || (d != FQ_F32 && d != c->dtype)) {
                    if (c->dtype == FQ_F32)
                        PyErr_Format(PyExc_TypeError, "%s: expected dtype float32, got %s", s->name, GOT);
                    else
                        PyErr_Format(PyExc_TypeError, "%s: expected dtype float32 or %s (like %s), got %s",
                                     s->name, fq_dtype_name(c->dtype), c->slots[0].name, GOT);
                    return -1;
                }
                c->gate_dtype = d;
                have_gate = 1;
                gate_first = s->name;
            } else if (!fq_float_dtype(t, &d) || d != c->gate_dtype) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype %s like %s, got %s", s->name,
                             fq_dtype_name(c->gate_dtype), gate_first, GOT);
                return -1;
            }
            break;
        case FQ_PARAM:
            if (!have_param) {
                if (!fq_float_dtype(t, &d) || !(d == FQ_F32 || (d == FQ_F64 && c->dtype == FQ_F64))) {
                    PyErr_Format(PyExc_TypeError,
                                 "%s: expected dtype float32 (float64 only with float64 inputs), got %s",
                                 s->name, GOT);
                    return -1;
                }
                c->param_dtype = d;
                have_param = 1;
                param_first = s->name;
            } else if (!fq_float_dtype(t, &d) || d != c->param_dtype) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype %s like %s, got %s", s->name,
                             fq_dtype_name(c->param_dtype), param_first, GOT);
                return -1;
            }
            break;
        case FQ_CUCK:
            if (t.code != kDLInt || t.bits != 64 || t.lanes != 1) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype int64, got %s", s->name, GOT);
                return -1;
            }
            break;
        case FQ_STATE:
        case FQ_POOL:
        case FQ_INTER:
        case FQ_CKPT:
            if (!have_state) {
                int ok = fq_float_dtype(t, &d) && (d == FQ_F32 || (d == FQ_F64 && c->dtype == FQ_F64));
                if (!ok) {
                    if (c->dtype == FQ_F64)
                        PyErr_Format(PyExc_TypeError, "%s: expected dtype float32 or float64, got %s",
                                     s->name, GOT);
                    else
                        PyErr_Format(PyExc_TypeError,
                                     "%s: expected dtype float32 (states are float32; float64 only "
                                     "with float64 inputs), got %s",
                                     s->name, GOT);
                    return -1;
                }
                c->state_dtype = d;
                have_state = 1;
                state_first = s->name;
            } else if (!fq_float_dtype(t, &d) || d != c->state_dtype) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype %s like %s, got %s", s->name,
                             fq_dtype_name(c->state_dtype), state_first, GOT);
                return -1;
            }
            break;
        case FQ_SEQ:
        case FQ_IDX:
        case FQ_ACC: {
            int is64 = 0;
            if (!fq_is_int_dtype(t, &is64)) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype int32 or int64, got %s", s->name, GOT);
                return -1;
            }
            if (s->kind == FQ_SEQ) c->seq_int64 = is64;
            else if (s->kind == FQ_IDX) c->idx_int64 = is64;
            else c->acc_int64 = is64;
            break;
        }
        case FQ_WS:
            if (t.code != kDLUInt || t.bits != 8 || t.lanes != 1) {
                PyErr_Format(PyExc_TypeError, "%s: expected dtype uint8, got %s", s->name, GOT);
                return -1;
            }
            break;
        }
    }
    return 0;
}
#undef GOT

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

/* The shape of the slot's tensor t as text, formatted only for a message. */
#define GOT fq_dims_str(t->ndim, t->shape, got, sizeof got)

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
        switch (s->kind) {
        case FQ_QK: {
            if (i == 0) {
                if (t->ndim != 4) {
                    PyErr_Format(PyExc_ValueError, "%s: expected a 4-d array [B, T, H, K], got shape %s",
                                 s->name, GOT);
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
                                 s->name, GOT);
                    return -1;
                }
                break;
            }
            int64_t dims[4] = {c->B, c->T, c->H, c->K};
            if (!fq_shape_is(t, 4, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s like %s, got %s", s->name,
                             fq_dims_str(4, dims, want, sizeof want), c->slots[0].name, GOT);
                return -1;
            }
            break;
        }
        case FQ_V: {
            if (!have_v) {
                if (t->ndim != 4 || t->shape[0] != c->B || t->shape[1] != c->T) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s: expected shape [B=%lld, T=%lld, HV, V] (B, T of %s), got %s",
                                 s->name, (long long)c->B, (long long)c->T, c->slots[0].name, GOT);
                    return -1;
                }
                c->HV = t->shape[2];
                c->V = t->shape[3];
                if (c->HV < 1 || c->V < 1) {
                    PyErr_Format(PyExc_ValueError, "%s: expected HV >= 1 and V >= 1, got shape %s",
                                 s->name, GOT);
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
                             fq_dims_str(4, dims, want, sizeof want), GOT);
                return -1;
            }
            break;
        }
        case FQ_GATE: {
            int64_t dims[3] = {c->B, c->T, c->HV};
            if (!fq_shape_is(t, 3, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s ([B, T, HV]), got %s", s->name,
                             fq_dims_str(3, dims, want, sizeof want), GOT);
                return -1;
            }
            break;
        }
        case FQ_SEQ:
            if (t->ndim != 1 || t->shape[0] < 2) {
                PyErr_Format(PyExc_ValueError,
                             "%s: expected a 1-d array of N+1 >= 2 offsets, got shape %s", s->name, GOT);
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
        case FQ_IDX:
        case FQ_ACC: {
            int64_t dims[1] = {c->N};
            if (!fq_shape_is(t, 1, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s ([N], one %s per sequence), got %s",
                             s->name, fq_dims_str(1, dims, want, sizeof want),
                             s->kind == FQ_IDX ? "slot" : "count", GOT);
                return -1;
            }
            break;
        }
        case FQ_CUCK: {
            int64_t dims[1] = {c->N + 1};
            if (!fq_shape_is(t, 1, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s ([N + 1]), got %s", s->name,
                             fq_dims_str(1, dims, want, sizeof want), GOT);
                return -1;
            }
            break;
        }
        case FQ_PARAM: {
            int64_t dims[1] = {c->HV};
            if (!fq_shape_is(t, 1, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s ([HV], one per value head), got %s",
                             s->name, fq_dims_str(1, dims, want, sizeof want), GOT);
                return -1;
            }
            break;
        }
        case FQ_STATE:
        case FQ_CKPT: {
            const int64_t lead = s->kind == FQ_STATE ? c->N : (c->ck_every > 0 ? c->B * (c->T / c->ck_every) : 0);
            int64_t dims[4] = {lead, c->HV, c->vk ? c->V : c->K, c->vk ? c->K : c->V};
            if (!fq_shape_is(t, 4, dims)) {
                PyErr_Format(PyExc_ValueError, "%s: expected shape %s (%s), got %s", s->name,
                             fq_dims_str(4, dims, want, sizeof want),
                             s->kind == FQ_STATE ? (c->vk ? "[N, HV, V, K]" : "[N, HV, K, V]")
                                                 : (c->vk ? "[B * (T / checkpoint_every), HV, V, K]"
                                                          : "[B * (T / checkpoint_every), HV, K, V]"),
                             GOT);
                return -1;
            }
            break;
        }
        case FQ_INTER:
            if (t->ndim != 5 || t->shape[1] < 1 || (c->B > 0 && t->shape[0] != c->N) ||
                t->shape[2] != c->HV || t->shape[3] != (c->vk ? c->V : c->K) ||
                t->shape[4] != (c->vk ? c->K : c->V)) {
                PyErr_Format(PyExc_ValueError,
                             "%s: expected shape [N, Ti, %lld, %lld, %lld] (%s, Ti >= 1), got %s", s->name,
                             (long long)c->HV, (long long)(c->vk ? c->V : c->K),
                             (long long)(c->vk ? c->K : c->V),
                             c->vk ? "[N, Ti, HV, V, K]" : "[N, Ti, HV, K, V]", GOT);
                return -1;
            }
            if (c->B == 0) c->N = t->shape[0]; /* commit: N from here */
            c->Ti = t->shape[1];
            break;
        case FQ_POOL:
            if (c->HV == 0 && t->ndim == 4) { /* commit: HV, K, V from the pool */
                c->HV = t->shape[1];
                c->K = c->vk ? t->shape[3] : t->shape[2];
                c->V = c->vk ? t->shape[2] : t->shape[3];
            }
            if (t->ndim != 4 || t->shape[0] < 1 || t->shape[1] != c->HV ||
                t->shape[2] != (c->vk ? c->V : c->K) || t->shape[3] != (c->vk ? c->K : c->V)) {
                PyErr_Format(PyExc_ValueError,
                             "%s: expected shape [P, %lld, %lld, %lld] (%s, P >= 1), got %s", s->name,
                             (long long)c->HV, (long long)(c->vk ? c->V : c->K), (long long)(c->vk ? c->K : c->V),
                             c->vk ? "[P, HV, V, K]" : "[P, HV, K, V]", GOT);
                return -1;
            }
            c->P = t->shape[0];
            if (c->B == 0) break; /* commit: N is known only after intermediate_states */
            if (!have_idx && c->P != c->N) {
                PyErr_Format(PyExc_ValueError,
                             "%s: without state_indices the pool must have N=%lld slots, got shape %s",
                             s->name, (long long)c->N, GOT);
                return -1;
            }
            break;
        case FQ_WS:
            break; /* any shape: its byte count is checked at dispatch */
        }
    }
    return 0;
}
#undef GOT

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
int fq_call_validate(fq_call *c, PyObject *stream)
{
    if (fq_parse_stream(stream, c) < 0) return -1;
    if (fq_stage_import(c, c->exchange && (!stream || stream == Py_None)) < 0) return -1;
    if (fq_stage_dtype(c) < 0) return -1;
    if (fq_stage_shape(c) < 0) return -1;
    if (fq_stage_memory(c) < 0) return -1;
    return 0;
}

int fq_parse_layout(PyObject *obj, int *vk)
{
    *vk = 0;
    if (!obj || obj == Py_None) return 0;
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_CompareWithASCIIString(obj, "kv") == 0) return 0;
        if (PyUnicode_CompareWithASCIIString(obj, "vk") == 0) {
            *vk = 1;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "state_layout: expected \"kv\" (states [.., K, V]) or \"vk\" ([.., V, K]), got %R", obj);
    return -1;
}

/* scale is a required keyword; None means the usual K^-1/2 (*use_default),
 * resolved once K is known. Checked before any array is imported. */
int fq_parse_scale(PyObject *obj, const char *fn, double *scale, int *use_default)
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
    if (PyBool_Check(obj) || PyComplex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "scale: expected a float, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *scale = PyFloat_AsDouble(obj);
    if (*scale == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "scale: expected a float, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!isfinite(*scale)) {
        PyErr_Format(PyExc_ValueError, "scale: expected a finite float, got %R", obj);
        return -1;
    }
    return 0;
}

/* Sizes, dtypes and options common to every op. */
void fq_call_params(const fq_call *c, fq_gdn_params *p, double scale, int use_qk_l2norm,
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
    p->num_accepted_is_int64 = c->acc_int64;
    p->state_vk = c->vk;
    p->checkpoint_every = c->ck_every;
    p->Ti = c->Ti;
    p->gate_param_dtype = c->param_dtype;
    p->num_threads = num_threads;
    p->stream = c->stream;
    p->device = c->device.device_type == kDLCUDA ? (int)c->device.device_id : 0;
}
