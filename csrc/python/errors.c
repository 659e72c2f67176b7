/*
 * errors.c — what every file of the CPython binding shares: flashqla._C.Error,
 * the mapping of a core status to a Python exception, moving a pending
 * exception aside and back, and the text of devices, dtypes and shapes in
 * messages. Calls nothing else in csrc/python/.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "gdn.h"
#include "errors.h"

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

const char *fq_dl_dtype_str(DLDataType t, char *buf, size_t n)
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

/* ============================================================ arguments == */

int fq_int_arg(PyObject *obj, const char *name, long long lo, long long hi, const char *expected,
               long long *out)
{
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected %s, got %.200s", name, expected,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *ix = PyNumber_Index(obj);
    if (!ix) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(ix, &overflow);
    Py_DECREF(ix);
    if (v == -1 && !overflow && PyErr_Occurred()) return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s: expected %s, got %R", name, expected, obj);
        return -1;
    }
    *out = v;
    return 0;
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
PyObject *fq_error_take(void)
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

void fq_error_give(PyObject *exc) /* steals exc; NULL: nothing */
{
    if (!exc) return;
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}
