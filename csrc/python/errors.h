/*
 * errors.h — what every file of the CPython binding shares (errors.c): the
 * exception type, status -> exception, and message text. Internal: include
 * after Python.h, dlpack.h and gdn.h.
 */
#ifndef FQ_PY_ERRORS_H
#define FQ_PY_ERRORS_H

/* flashqla._C.Error (a RuntimeError), created by the module init. */
extern PyObject *fq_Error;

/* Sets the Python exception for a failed core status, with fq_last_error(). */
void fq_raise_status(fq_status st);

/* The pending exception as one object (NULL if none), and back (steals exc;
 * NULL: nothing): for code that must run Python calls while one is pending. */
PyObject *fq_error_take(void);
void fq_error_give(PyObject *exc);

/* An int argument (anything with __index__, not a bool) in [lo, hi] into *out;
 * else TypeError / ValueError naming `name` and saying `expected` (e.g. "an
 * int from 0 to 4096"). Returns 0 or -1 with the exception set. */
int fq_int_arg(PyObject *obj, const char *name, long long lo, long long hi, const char *expected,
               long long *out);

/* "cpu", "cuda:1", ... into buf (n bytes); returns buf. */
const char *fq_device_str(DLDevice d, char *buf, size_t n);
/* "float32", "bfloat16", "int64", ... into buf (n bytes); returns buf. */
const char *fq_dl_dtype_str(DLDataType t, char *buf, size_t n);
/* "[2, 100, 4, 128]" into buf (n bytes); returns buf. */
const char *fq_dims_str(int ndim, const int64_t *dims, char *buf, size_t n);

#endif /* FQ_PY_ERRORS_H */
