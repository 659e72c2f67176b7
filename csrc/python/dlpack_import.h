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
    const DLPackExchangeAPI *xapi;       /* the C exchange API it came through */
    DLTensor local;                      /* t for a non-owning exchange-API export */
} fq_array;

/* Imports one array argument `obj` (an object with __dlpack__, or a capsule)
 * for the argument called `name`. `cuda_stream` (borrowed) is passed as
 * __dlpack__(stream=...) to CUDA arrays only. With `exchange`, an object
 * whose type has the DLPack C exchange API (DLPack 1.3) is taken through it
 * instead: no Python call, none of __dlpack__'s checks and no stream
 * hand-over (the caller has done those; see _C.recurrent's exchange_api);
 * a non-owning export unless `writable` (an owning one carries the
 * read-only flag). On failure (-1, exception set) the caller still runs
 * fq_array_release. */
int fq_array_import(fq_array *a, PyObject *obj, const char *name, PyObject *cuda_stream,
                    int exchange, int writable);
/* _C.exchange_api(type) -> bool: arrays of that type are taken through its
 * DLPack C exchange API when a call asks for it (exchange_api=True). */
PyObject *fq_exchange_api_py(PyObject *self, PyObject *tp);
/* The producer's current work stream on the array's CUDA device, for an
 * array taken through the C exchange API (else NULL: *stream untouched but
 * zeroed). Returns 0, or -1 with an exception set. */
int fq_current_work_stream(const fq_array *a, void **stream);
/* Calls the deleter of a taken tensor (with the GIL held) and drops the
 * capsule. Safe on an empty fq_array. */
void fq_array_release(fq_array *a);
/* _C.dlpack_info(capsule) -> (device_type, device_id, dtype): what an unused
 * DLPack capsule holds, read without taking it (the capsule stays usable),
 * so that the Python layer can hand a raw capsule to the framework that
 * can hold it. TypeError for anything that is not an unused DLPack capsule. */
PyObject *fq_dlpack_info(PyObject *self, PyObject *capsule);

#endif /* FQ_PY_DLPACK_IMPORT_H */
