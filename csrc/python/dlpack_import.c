/*
 * dlpack_import.c — step 1 of a call: one array argument taken in as a DLPack
 * tensor, from an object with __dlpack__/__dlpack_device__ (asked for a
 * versioned capsule, legacy on TypeError; CUDA arrays get stream=) or from a
 * raw capsule. A capsule taken is renamed used_* at once, so from then on its
 * deleter is ours to call (fq_array_release), on every path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "gdn.h"
#include "errors.h"
#include "dlpack_import.h"

/* Re-raises the pending exception of a producer's __dlpack__ as TypeError
 * (the producer's TypeError or BufferError: this array cannot be exported as
 * it is, e.g. an object dtype or a tensor that requires grad) or ValueError
 * (any other Exception), with the argument's name and the original type in
 * front and the original chained as __cause__. Exceptions that are no
 * Exception (KeyboardInterrupt, SystemExit) pass through as they are. */
static void fq_prefix_error(const char *name, const char *what)
{
    PyObject *exc = fq_error_take(), *text = NULL, *renamed = NULL;
    if (!exc || !PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_Exception)) {
        fq_error_give(exc);
        return;
    }
    PyObject *type = PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_TypeError) ||
                             PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_BufferError)
                         ? PyExc_TypeError
                         : PyExc_ValueError;
    text = PyObject_Str(exc);
    if (!text) {
        PyErr_Clear();
        fq_error_give(exc);
        return;
    }
    PyErr_Format(type, "%s: %s: %s: %U", name, what, Py_TYPE(exc)->tp_name, text);
    Py_DECREF(text);
    renamed = fq_error_take();
    if (renamed) PyException_SetCause(renamed, exc); /* steals exc */
    else Py_DECREF(exc);
    fq_error_give(renamed);
}
/* Calls the deleter of a taken tensor (with the GIL held) and drops the
 * capsule. Safe on an empty fq_array. */
void fq_array_release(fq_array *a)
{
    if (a->versioned) {
        if (a->versioned->deleter) a->versioned->deleter(a->versioned);
    } else if (a->legacy) {
        if (a->legacy->deleter) a->legacy->deleter(a->legacy);
    }
    Py_CLEAR(a->capsule);
    memset(a, 0, sizeof *a);
}

/* Adopts the owning versioned tensor m (its deleter runs in fq_array_release
 * from here on, also when this fails): the major version flashqla reads
 * (else only version / manager_ctx / deleter may be read, as the spec asks),
 * the tensor and its read-only flag. */
static int fq_array_adopt_versioned(fq_array *a, DLManagedTensorVersioned *m, const char *name)
{
    a->versioned = m;
    if (m->version.major != DLPACK_MAJOR_VERSION) {
        PyErr_Format(PyExc_ValueError,
                     "%s: DLPack version %u.%u is not supported (flashqla reads major version %d)",
                     name, (unsigned)m->version.major, (unsigned)m->version.minor, DLPACK_MAJOR_VERSION);
        return -1;
    }
    a->t = &m->dl_tensor;
    a->readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    return 0;
}

/* Only CPU and CUDA arrays. */
static int fq_array_check_device(const fq_array *a, const char *name)
{
    DLDeviceType dt = a->t->device.device_type;
    if (dt != kDLCPU && dt != kDLCUDA) {
        char dev[64];
        PyErr_Format(PyExc_ValueError, "%s: arrays on %s are not supported (only CPU and CUDA)",
                     name, fq_device_str(a->t->device, dev, sizeof dev));
        return -1;
    }
    return 0;
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
        if (fq_array_adopt_versioned(a, m, name) < 0) return -1;
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
    return fq_array_check_device(a, name);
}

/* ------------------------------------- the C exchange API (DLPack 1.3) ---- */

/* Array types seen in exchange mode and their exchange table (NULL: none), so
 * the attribute is looked up once per type, as the specification allows (a
 * producer's table is static, alive for the process). The cache holds a
 * reference to each type; a type past the last entry is looked up each call. */
#define FQ_XAPI_TYPES 8
static struct {
    PyTypeObject *type;
    const DLPackExchangeAPI *api;
} fq_xapi_cache[FQ_XAPI_TYPES];
static int fq_xapi_count;

/* The exchange table of `tp`, or NULL (no table, or not one of major version
 * 1: an older one is taken from the chain); -1 only on an error other than
 * a missing attribute. */
static int fq_exchange_api(PyTypeObject *tp, const DLPackExchangeAPI **out)
{
    *out = NULL;
    for (int i = 0; i < fq_xapi_count; i++)
        if (fq_xapi_cache[i].type == tp) {
            *out = fq_xapi_cache[i].api;
            return 0;
        }
    PyObject *cap = PyObject_GetAttrString((PyObject *)tp, DLPACK_EXCHANGE_API_ATTR);
    if (!cap) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
    } else {
        if (PyCapsule_CheckExact(cap) && PyCapsule_IsValid(cap, DLPACK_EXCHANGE_API_CAPSULE_NAME)) {
            const DLPackExchangeAPIHeader *h =
                (const DLPackExchangeAPIHeader *)PyCapsule_GetPointer(cap, DLPACK_EXCHANGE_API_CAPSULE_NAME);
            while (h && h->version.major > DLPACK_MAJOR_VERSION) h = h->prev_api;
            const DLPackExchangeAPI *api = (const DLPackExchangeAPI *)h;
            if (api && api->header.version.major == DLPACK_MAJOR_VERSION &&
                api->managed_tensor_from_py_object_no_sync && api->current_work_stream)
                *out = api;
        }
        PyErr_Clear(); /* a malformed attribute is no table: the __dlpack__ path */
        Py_DECREF(cap);
    }
    if (fq_xapi_count < FQ_XAPI_TYPES) {
        fq_xapi_cache[fq_xapi_count].type = (PyTypeObject *)Py_NewRef((PyObject *)tp);
        fq_xapi_cache[fq_xapi_count].api = *out;
        fq_xapi_count++;
    }
    return 0;
}

/* Takes `obj` through its type's exchange table: a non-owning DLTensor for an
 * argument the core only reads (when the producer offers that export), else
 * an owning versioned tensor (its read-only flag honoured, its deleter ours
 * to call). The producer's failure is re-raised naming the argument. */
static int fq_array_take_exchange(fq_array *a, PyObject *obj, const DLPackExchangeAPI *api,
                                  const char *name, int writable)
{
    a->xapi = api;
    if (!writable && api->dltensor_from_py_object_no_sync) {
        if (api->dltensor_from_py_object_no_sync(obj, &a->local) != 0) {
            fq_prefix_error(name, "DLPack C exchange API export failed");
            return -1;
        }
        a->t = &a->local;
        a->readonly = 0;
    } else {
        DLManagedTensorVersioned *m = NULL;
        if (api->managed_tensor_from_py_object_no_sync(obj, &m) != 0 || !m) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: the DLPack C exchange API gave no tensor", name);
            else
                fq_prefix_error(name, "DLPack C exchange API export failed");
            return -1;
        }
        if (fq_array_adopt_versioned(a, m, name) < 0) return -1;
    }
    return fq_array_check_device(a, name);
}

PyObject *fq_exchange_api_py(PyObject *self, PyObject *tp)
{
    const DLPackExchangeAPI *api = NULL;
    (void)self;
    if (!PyType_Check(tp))
        return PyErr_Format(PyExc_TypeError, "exchange_api: expected a type, got %.200s", Py_TYPE(tp)->tp_name);
    if (fq_exchange_api((PyTypeObject *)tp, &api) < 0) return NULL;
    return PyBool_FromLong(api != NULL);
}

int fq_current_work_stream(const fq_array *a, void **stream)
{
    *stream = NULL;
    if (!a->xapi || !a->t || a->t->device.device_type != kDLCUDA) return 0;
    if (a->xapi->current_work_stream(kDLCUDA, a->t->device.device_id, stream) != 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "stream: the producer gave no current stream");
        return -1;
    }
    return 0;
}

PyObject *fq_dlpack_info(PyObject *self, PyObject *capsule)
{
    const DLTensor *t = NULL;
    char dt[64];
    (void)self;
    if (PyCapsule_CheckExact(capsule) && PyCapsule_IsValid(capsule, DLPACK_VERSIONED_TENSOR_UNUSED_NAME)) {
        const DLManagedTensorVersioned *m = (const DLManagedTensorVersioned *)PyCapsule_GetPointer(
            capsule, DLPACK_VERSIONED_TENSOR_UNUSED_NAME);
        if (!m) return NULL;
        if (m->version.major != DLPACK_MAJOR_VERSION)
            return PyErr_Format(PyExc_ValueError,
                                "DLPack version %u.%u is not supported (flashqla reads major version %d)",
                                (unsigned)m->version.major, (unsigned)m->version.minor,
                                DLPACK_MAJOR_VERSION);
        t = &m->dl_tensor;
    } else if (PyCapsule_CheckExact(capsule) && PyCapsule_IsValid(capsule, DLPACK_TENSOR_UNUSED_NAME)) {
        const DLManagedTensor *m =
            (const DLManagedTensor *)PyCapsule_GetPointer(capsule, DLPACK_TENSOR_UNUSED_NAME);
        if (!m) return NULL;
        t = &m->dl_tensor;
    } else {
        return PyErr_Format(PyExc_TypeError, "expected an unused DLPack capsule, got %.200s",
                            Py_TYPE(capsule)->tp_name);
    }
    return Py_BuildValue("(iis)", (int)t->device.device_type, (int)t->device.device_id,
                         fq_dl_dtype_str(t->dtype, dt, sizeof dt));
}

/* Imports one array argument. `cuda_stream` (borrowed) is passed as
 * __dlpack__(stream=...) to CUDA arrays only. */
int fq_array_import(fq_array *a, PyObject *obj, const char *name, PyObject *cuda_stream,
                    int exchange, int writable)
{
    PyObject *dev = NULL, *method = NULL, *kwargs = NULL, *empty = NULL, *version = NULL;
    PyObject *capsule = NULL;
    int rc = -1;

    if (PyCapsule_CheckExact(obj)) return fq_array_take_capsule(a, obj, name);
    if (exchange) {
        const DLPackExchangeAPI *api = NULL;
        if (fq_exchange_api(Py_TYPE(obj), &api) < 0) return -1;
        if (api) return fq_array_take_exchange(a, obj, api, name, writable);
    }

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
