/*
 * dlpack_import.h — one array argument taken in as a DLPack tensor
 * (dlpack_import.c). Internal: include after Python.h, dlpack.h and gdn.h.
 */
#ifndef FQ_PY_DLPACK_IMPORT_H
#define FQ_PY_DLPACK_IMPORT_H

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

/* Imports one array argument `obj` (an object with __dlpack__, or a capsule)
 * for the argument called `name`. `cuda_stream` (borrowed) is passed as
 * __dlpack__(stream=...) to CUDA arrays only. On failure (-1, exception set)
 * the caller still runs fq_array_release. */
int fq_array_import(fq_array *a, PyObject *obj, const char *name, PyObject *cuda_stream);
/* Calls the deleter of a taken tensor (with the GIL held) and drops the
 * capsule. Safe on an empty fq_array. */
void fq_array_release(fq_array *a);
/* _C.dlpack_info(capsule) -> (device_type, device_id, dtype): what an unused
 * DLPack capsule holds, read without taking it (the capsule stays usable),
 * so that the Python layer can hand a raw capsule to the framework that
 * can hold it. TypeError for anything that is not an unused DLPack capsule. */
PyObject *fq_dlpack_info(PyObject *self, PyObject *capsule);

#endif /* FQ_PY_DLPACK_IMPORT_H */
