/*
 * dlpack_export.c — _C.Buffer and _C.empty: memory owned by flashqla (malloc
 * or cudaMalloc) exported zero-copy through __dlpack__ / __dlpack_device__,
 * for frameworks that cannot hand out writable arrays (JAX). Part of the
 * CPython binding (module.c adds it to the module); same reference
 * discipline: every PyObject * starts NULL, one fail: label releases what a
 * function holds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"
#include "gdn.h"
#include "errors.h"
#include "dlpack_export.h"

#define FQ_BUFFER_MAX_NDIM 8     /* rank limit of _C.Buffer                   */
#define FQ_BUFFER_ALIGN 64       /* CPU buffers: cache line / AVX-512 aligned  */

/* dtypes that _C.empty can make */
static const struct {
    const char *name;
    uint8_t code, bits;
} fq_buffer_dtypes[] = {
    {"float32", kDLFloat, 32}, {"float16", kDLFloat, 16}, {"bfloat16", kDLBfloat, 16},
    {"float64", kDLFloat, 64}, {"int32", kDLInt, 32},     {"int64", kDLInt, 64},
    {"int8", kDLInt, 8},       {"uint8", kDLUInt, 8},     {"bool", kDLBool, 8},
};
#define FQ_N_BUFFER_DTYPES (sizeof fq_buffer_dtypes / sizeof fq_buffer_dtypes[0])

/* ================================================================ Buffer == */

/* Memory owned by flashqla, handed out through DLPack. Each export holds a
 * reference to the Buffer (manager_ctx) until the consumer's deleter runs. */
typedef struct {
    PyObject_HEAD
    void *data;
    size_t nbytes;
    DLDevice device;
    DLDataType dtype;
    int ndim;
    int64_t shape[FQ_BUFFER_MAX_NDIM];
    int64_t strides[FQ_BUFFER_MAX_NDIM];
} fq_buffer;

/* One exported tensor: the managed struct plus its own shape/strides. */
typedef struct {
    DLManagedTensorVersioned m;
    int64_t shape[FQ_BUFFER_MAX_NDIM];
    int64_t strides[FQ_BUFFER_MAX_NDIM];
} fq_export_versioned;

typedef struct {
    DLManagedTensor m;
    int64_t shape[FQ_BUFFER_MAX_NDIM];
    int64_t strides[FQ_BUFFER_MAX_NDIM];
} fq_export_legacy;

/* The consumer may call a deleter from any thread, with or without the GIL. */
static void fq_export_drop_owner(void *owner)
{
    if (!owner || !Py_IsInitialized()) return; /* interpreter gone: nothing to release */
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF((PyObject *)owner);
    PyGILState_Release(gil);
}

static void fq_export_versioned_deleter(DLManagedTensorVersioned *self)
{
    fq_export_drop_owner(self->manager_ctx);
    free(self);
}

static void fq_export_legacy_deleter(DLManagedTensor *self)
{
    fq_export_drop_owner(self->manager_ctx);
    free(self);
}

/* Capsule destructors: a capsule nobody consumed still owns its tensor. */
static void fq_capsule_versioned_destructor(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, DLPACK_VERSIONED_TENSOR_UNUSED_NAME)) return; /* used_* */
    DLManagedTensorVersioned *m =
        (DLManagedTensorVersioned *)PyCapsule_GetPointer(capsule, DLPACK_VERSIONED_TENSOR_UNUSED_NAME);
    if (m && m->deleter) m->deleter(m);
}

static void fq_capsule_legacy_destructor(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, DLPACK_TENSOR_UNUSED_NAME)) return;
    DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(capsule, DLPACK_TENSOR_UNUSED_NAME);
    if (m && m->deleter) m->deleter(m);
}

static void fq_buffer_fill_tensor(fq_buffer *self, DLTensor *t, int64_t *shape, int64_t *strides)
{
    memcpy(shape, self->shape, sizeof self->shape);
    memcpy(strides, self->strides, sizeof self->strides);
    t->data = self->data;
    t->device = self->device;
    t->ndim = self->ndim;
    t->dtype = self->dtype;
    t->shape = shape;
    t->strides = strides;
    t->byte_offset = 0;
}

static PyObject *fq_buffer_dlpack(fq_buffer *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    PyObject *capsule = NULL;
    int versioned = 0;
    char dev[64];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOO:__dlpack__", kwlist, &stream, &max_version,
                                     &dl_device, &copy))
        return NULL;
    if (stream != Py_None && !PyIndex_Check(stream)) {
        PyErr_Format(PyExc_TypeError, "__dlpack__: stream must be an int or None, got %.200s",
                     Py_TYPE(stream)->tp_name);
        return NULL;
    }
    /* Our memory has no pending work of its own: every write to it was
     * queued by the caller on the caller's stream, so `stream` needs no wait. */
    if (max_version != Py_None) {
        if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) != 2) {
            PyErr_SetString(PyExc_TypeError, "__dlpack__: max_version must be a tuple (major, minor)");
            return NULL;
        }
        long major = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0));
        if (major == -1 && PyErr_Occurred()) return NULL;
        versioned = major >= 1;
    }
    if (dl_device != Py_None) {
        long type = -1, id = -1;
        if (!PyTuple_Check(dl_device)) {
            PyErr_SetString(PyExc_TypeError, "__dlpack__: dl_device must be (device_type, device_id)");
            return NULL;
        }
        if (!PyArg_ParseTuple(dl_device, "ll;__dlpack__: dl_device must be (device_type, device_id)",
                              &type, &id))
            return NULL;
        if (type != (long)self->device.device_type ||
            (self->device.device_type == kDLCUDA && id != (long)self->device.device_id)) {
            PyErr_Format(PyExc_BufferError, "__dlpack__: the buffer lives on %s and cannot be exported to (%ld, %ld)",
                         fq_device_str(self->device, dev, sizeof dev), type, id);
            return NULL;
        }
    }
    if (copy != Py_None) {
        int c = PyObject_IsTrue(copy);
        if (c < 0) return NULL;
        if (c) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: copy=True is not supported (exports are zero-copy)");
            return NULL;
        }
    }
    if (versioned) {
        fq_export_versioned *e = (fq_export_versioned *)calloc(1, sizeof *e);
        if (!e) return PyErr_NoMemory();
        e->m.version.major = DLPACK_MAJOR_VERSION;
        e->m.version.minor = DLPACK_MINOR_VERSION;
        e->m.flags = 0; /* writable, not a copy */
        e->m.manager_ctx = Py_NewRef((PyObject *)self);
        e->m.deleter = fq_export_versioned_deleter;
        fq_buffer_fill_tensor(self, &e->m.dl_tensor, e->shape, e->strides);
        capsule = PyCapsule_New(&e->m, DLPACK_VERSIONED_TENSOR_UNUSED_NAME, fq_capsule_versioned_destructor);
        if (!capsule) fq_export_versioned_deleter(&e->m);
    } else {
        fq_export_legacy *e = (fq_export_legacy *)calloc(1, sizeof *e);
        if (!e) return PyErr_NoMemory();
        e->m.manager_ctx = Py_NewRef((PyObject *)self);
        e->m.deleter = fq_export_legacy_deleter;
        fq_buffer_fill_tensor(self, &e->m.dl_tensor, e->shape, e->strides);
        capsule = PyCapsule_New(&e->m, DLPACK_TENSOR_UNUSED_NAME, fq_capsule_legacy_destructor);
        if (!capsule) fq_export_legacy_deleter(&e->m);
    }
    return capsule;
}

static PyObject *fq_buffer_dlpack_device(fq_buffer *self, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue("(ii)", (int)self->device.device_type, (int)self->device.device_id);
}

static void fq_buffer_dealloc(fq_buffer *self)
{
    if (self->data) {
        if (self->device.device_type == kDLCUDA) {
            int device = (int)self->device.device_id;
            void *data = self->data;
            Py_BEGIN_ALLOW_THREADS
            (void)fq_cuda_free(device, data); /* a failure here has nobody to tell */
            Py_END_ALLOW_THREADS
        } else {
            free(self->data);
        }
        self->data = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *fq_buffer_get_shape(fq_buffer *self, void *closure)
{
    PyObject *shape = NULL;
    (void)closure;
    shape = PyTuple_New(self->ndim);
    if (!shape) return NULL;
    for (int i = 0; i < self->ndim; i++) {
        PyObject *d = PyLong_FromLongLong(self->shape[i]);
        if (!d) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, d);
    }
    return shape;
}

static const char *fq_buffer_dtype_name(const fq_buffer *self)
{
    for (size_t i = 0; i < FQ_N_BUFFER_DTYPES; i++)
        if (fq_buffer_dtypes[i].code == self->dtype.code && fq_buffer_dtypes[i].bits == self->dtype.bits)
            return fq_buffer_dtypes[i].name;
    return "unknown";
}

static PyObject *fq_buffer_get_dtype(fq_buffer *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(fq_buffer_dtype_name(self));
}

static PyObject *fq_buffer_get_device(fq_buffer *self, void *closure)
{
    char dev[64];
    (void)closure;
    return PyUnicode_FromString(fq_device_str(self->device, dev, sizeof dev));
}

static PyObject *fq_buffer_get_nbytes(fq_buffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->nbytes);
}

static PyObject *fq_buffer_get_data_ptr(fq_buffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromVoidPtr(self->data);
}

static PyObject *fq_buffer_repr(fq_buffer *self)
{
    char dims[160], dev[64];
    return PyUnicode_FromFormat("flashqla._C.Buffer(shape=%s, dtype=%s, device=%s)",
                                fq_dims_str(self->ndim, self->shape, dims, sizeof dims),
                                fq_buffer_dtype_name(self), fq_device_str(self->device, dev, sizeof dev));
}

static PyMethodDef fq_buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))fq_buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) -> capsule\n\n"
     "A versioned capsule when max_version >= (1, 0), else a legacy one. Zero-copy."},
    {"__dlpack_device__", (PyCFunction)fq_buffer_dlpack_device, METH_NOARGS,
     "__dlpack_device__() -> (device_type, device_id)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef fq_buffer_getset[] = {
    {"shape", (getter)fq_buffer_get_shape, NULL, "shape (tuple of ints)", NULL},
    {"dtype", (getter)fq_buffer_get_dtype, NULL, "dtype name, e.g. \"float32\"", NULL},
    {"device", (getter)fq_buffer_get_device, NULL, "\"cpu\" or \"cuda:N\"", NULL},
    {"nbytes", (getter)fq_buffer_get_nbytes, NULL, "size of the data in bytes", NULL},
    {"data_ptr", (getter)fq_buffer_get_data_ptr, NULL, "address of the data", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject fq_buffer_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flashqla._C.Buffer",
    .tp_basicsize = sizeof(fq_buffer),
    .tp_dealloc = (destructor)fq_buffer_dealloc,
    .tp_repr = (reprfunc)fq_buffer_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Memory owned by flashqla (malloc or cudaMalloc), exported through DLPack.\n"
              "Made by flashqla._C.empty(shape, dtype, device_type, device_id).",
    .tp_methods = fq_buffer_methods,
    .tp_getset = fq_buffer_getset,
};

PyDoc_STRVAR(fq_empty_doc,
"empty(shape, dtype, device_type, device_id) -> Buffer\n\n"
"Uninitialised memory owned by flashqla, exported zero-copy through\n"
"__dlpack__ (e.g. jax.dlpack.from_dlpack(buf)). dtype: \"float32\", \"float16\",\n"
"\"bfloat16\", \"float64\", \"int32\", \"int64\", \"int8\", \"uint8\" or \"bool\";\n"
"device_type: 1 (CPU) or 2 (CUDA), or \"cpu\"/\"cuda\".");

static PyObject *fq_empty(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"shape", "dtype", "device_type", "device_id", NULL};
    PyObject *shape_obj = NULL, *dtype_obj = NULL, *devtype_obj = NULL, *seq = NULL;
    fq_buffer *buf = NULL;
    PyObject *result = NULL;
    int device_id = 0;
    long device_type = 0;
    const char *dtype = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|i:empty", kwlist, &shape_obj, &dtype_obj, &devtype_obj,
                                     &device_id))
        return NULL;

    if (PyUnicode_Check(devtype_obj)) {
        const char *s = PyUnicode_AsUTF8(devtype_obj);
        if (!s) goto fail;
        device_type = strcmp(s, "cpu") == 0 ? kDLCPU : strcmp(s, "cuda") == 0 ? kDLCUDA : -1;
    } else if (PyIndex_Check(devtype_obj)) {
        device_type = PyLong_AsLong(devtype_obj);
        if (device_type == -1 && PyErr_Occurred()) goto fail;
    } else {
        device_type = -1;
    }
    if (device_type != kDLCPU && device_type != kDLCUDA) {
        PyErr_Format(PyExc_ValueError, "device_type: expected 1 (CPU), 2 (CUDA), \"cpu\" or \"cuda\", got %R",
                     devtype_obj);
        goto fail;
    }
    if (device_id < 0) {
        PyErr_Format(PyExc_ValueError, "device_id: expected >= 0, got %d", device_id);
        goto fail;
    }

    if (!PyUnicode_Check(dtype_obj)) {
        PyErr_Format(PyExc_TypeError, "dtype: expected a dtype name such as \"float32\", got %.200s",
                     Py_TYPE(dtype_obj)->tp_name);
        goto fail;
    }
    dtype = PyUnicode_AsUTF8(dtype_obj);
    if (!dtype) goto fail;
    size_t di = 0;
    while (di < FQ_N_BUFFER_DTYPES && strcmp(fq_buffer_dtypes[di].name, dtype) != 0) di++;
    if (di == FQ_N_BUFFER_DTYPES) {
        PyErr_Format(PyExc_TypeError,
                     "dtype: expected one of float32, float16, bfloat16, float64, int32, int64, int8, "
                     "uint8, bool, got \"%s\"",
                     dtype);
        goto fail;
    }

    buf = PyObject_New(fq_buffer, &fq_buffer_type);
    if (!buf) goto fail;
    buf->data = NULL;
    buf->nbytes = 0;
    buf->device.device_type = (DLDeviceType)device_type;
    buf->device.device_id = device_type == kDLCUDA ? device_id : 0;
    buf->dtype.code = fq_buffer_dtypes[di].code;
    buf->dtype.bits = fq_buffer_dtypes[di].bits;
    buf->dtype.lanes = 1;
    buf->ndim = 0;
    memset(buf->shape, 0, sizeof buf->shape);
    memset(buf->strides, 0, sizeof buf->strides);

    if (PyIndex_Check(shape_obj)) {
        seq = PyTuple_Pack(1, shape_obj);
    } else {
        seq = PySequence_Fast(shape_obj, "shape: expected a sequence of ints");
    }
    if (!seq) goto fail;
    Py_ssize_t ndim = PySequence_Fast_GET_SIZE(seq);
    if (ndim > FQ_BUFFER_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "shape: at most %d dimensions, got %zd", FQ_BUFFER_MAX_NDIM, ndim);
        goto fail;
    }
    buf->ndim = (int)ndim;
    size_t itemsize = fq_buffer_dtypes[di].bits / 8;
    uint64_t numel = 1;
    int overflow = 0;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyIndex_Check(item)) {
            PyErr_Format(PyExc_TypeError, "shape: expected ints, got %.200s", Py_TYPE(item)->tp_name);
            goto fail;
        }
        long long d = PyLong_AsLongLong(item); /* uses __index__ (numpy ints too) */
        if (d == -1 && PyErr_Occurred()) goto fail;
        if (d < 0) {
            PyErr_Format(PyExc_ValueError, "shape: dimensions must be >= 0, got %lld", d);
            goto fail;
        }
        buf->shape[i] = d;
        if (d != 0 && numel > (uint64_t)INT64_MAX / (uint64_t)d) overflow = 1;
        else numel *= (uint64_t)d;
    }
    for (Py_ssize_t i = 0; i < ndim; i++)
        if (buf->shape[i] == 0) numel = 0, overflow = 0;
    if (overflow || numel > (uint64_t)INT64_MAX / itemsize) {
        PyErr_SetString(PyExc_ValueError, "shape: too many elements");
        goto fail;
    }
    int64_t stride = 1;
    for (int i = buf->ndim - 1; i >= 0; i--) {
        buf->strides[i] = stride;
        stride *= buf->shape[i] > 0 ? buf->shape[i] : 1;
    }
    buf->nbytes = (size_t)numel * itemsize;

    if (device_type == kDLCPU) {
        size_t alloc = buf->nbytes > 0 ? buf->nbytes : 1;
        if (alloc > SIZE_MAX - FQ_BUFFER_ALIGN) {
            PyErr_NoMemory();
            goto fail;
        }
        alloc = (alloc + FQ_BUFFER_ALIGN - 1) / FQ_BUFFER_ALIGN * FQ_BUFFER_ALIGN;
        buf->data = aligned_alloc(FQ_BUFFER_ALIGN, alloc);
        if (!buf->data) {
            PyErr_Format(PyExc_MemoryError, "empty: could not allocate %zu bytes", buf->nbytes);
            goto fail;
        }
    } else {
        void *ptr = NULL;
        size_t nbytes = buf->nbytes;
        fq_status st;
        Py_BEGIN_ALLOW_THREADS
        st = fq_cuda_alloc(device_id, nbytes, &ptr);
        Py_END_ALLOW_THREADS
        if (st != FQ_OK) {
            fq_raise_status(st);
            goto fail;
        }
        buf->data = ptr;
    }
    result = (PyObject *)buf;
    buf = NULL;
fail:
    Py_XDECREF(seq);
    Py_XDECREF((PyObject *)buf);
    return result;
}

static PyMethodDef fq_buffer_functions[] = {
    {"empty", (PyCFunction)(void (*)(void))fq_empty, METH_VARARGS | METH_KEYWORDS, fq_empty_doc},
    {NULL, NULL, 0, NULL},
};

int fq_buffer_add_to_module(PyObject *m)
{
    if (PyType_Ready(&fq_buffer_type) < 0) return -1;
    if (PyModule_AddObjectRef(m, "Buffer", (PyObject *)&fq_buffer_type) < 0) return -1;
    return PyModule_AddFunctions(m, fq_buffer_functions);
}
