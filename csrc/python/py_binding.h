/*
 * py_binding.h — what the two files of the CPython binding share (module.c:
 * argument import, validation, dispatch, module init; py_buffer.c: _C.Buffer
 * and _C.empty). Internal: include after Python.h, dlpack.h and gdn.h.
 */
#ifndef FQ_PY_BINDING_H
#define FQ_PY_BINDING_H

/* flashqla._C.Error (a RuntimeError), created by the module init. */
extern PyObject *fq_Error;

/* "cpu", "cuda:1", ... into buf (n bytes); returns buf. */
const char *fq_device_str(DLDevice d, char *buf, size_t n);
/* "[2, 100, 4, 128]" into buf (n bytes); returns buf. */
const char *fq_dims_str(int ndim, const int64_t *dims, char *buf, size_t n);
/* Sets the Python exception for a failed core status, with fq_last_error(). */
void fq_raise_status(fq_status st);

/* Readies _C.Buffer and adds it and _C.empty to the module; -1 with an
 * exception set on failure. */
int fq_buffer_add_to_module(PyObject *m);

#endif /* FQ_PY_BINDING_H */
