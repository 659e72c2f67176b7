/*
 * dlpack_export.h — _C.Buffer and _C.empty (dlpack_export.c). Internal:
 * include after Python.h.
 */
#ifndef FQ_PY_DLPACK_EXPORT_H
#define FQ_PY_DLPACK_EXPORT_H

/* Readies _C.Buffer and adds it and _C.empty to the module; -1 with an
 * exception set on failure. */
int fq_buffer_add_to_module(PyObject *m);

#endif /* FQ_PY_DLPACK_EXPORT_H */
