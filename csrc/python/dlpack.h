/*
 * dlpack.h — the DLPack data structures flashqla exchanges with PyTorch, JAX,
 * CuPy and NumPy, written for this project from the DLPack specification
 * (https://dmlc.github.io/dlpack/latest/c_api.html, ABI version 1). Only what
 * the binding needs: devices, dtypes, the tensor, both managed forms
 * (legacy DLManagedTensor and DLManagedTensorVersioned) and the C exchange
 * API table of DLPack 1.3.
 *
 * ABI notes that matter:
 *  - DLDevice.device_type is a 32-bit enum value; DLDataType is 4 bytes
 *    (code, bits, lanes).
 *  - In DLManagedTensorVersioned the first three fields (version,
 *    manager_ctx, deleter) stay put across major versions, so a consumer that
 *    rejects a newer major version can still call the deleter.
 *  - shape/strides are in elements; strides may be NULL (compact row-major);
 *    byte_offset is added to data to reach the first element.
 *  - Python capsule names: "dltensor" / "dltensor_versioned" before use,
 *    renamed "used_dltensor" / "used_dltensor_versioned" by the consumer that
 *    takes ownership (it then calls the deleter when done).
 */
#ifndef FQ_DLPACK_H
#define FQ_DLPACK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version this header describes. */
#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 0

/* Bits of DLManagedTensorVersioned.flags. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (1ULL << 0)  /* consumer must not write   */
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ULL << 1)  /* producer made a copy      */
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1ULL << 2)

/* Python capsule names. */
#define DLPACK_TENSOR_UNUSED_NAME "dltensor"
#define DLPACK_TENSOR_USED_NAME "used_dltensor"
#define DLPACK_VERSIONED_TENSOR_UNUSED_NAME "dltensor_versioned"
#define DLPACK_VERSIONED_TENSOR_USED_NAME "used_dltensor_versioned"

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

/* Where the memory lives. flashqla takes kDLCPU and kDLCUDA only. */
typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,     /* pinned host memory (cudaMallocHost) */
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13, /* cudaMallocManaged memory */
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;   /* ordinal; 0 for CPU */
} DLDevice;

/* Kind of number in DLDataType.code. */
typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6
    /* 7.. : 8/6/4-bit float formats (not used by flashqla) */
} DLDataTypeCode;

/* e.g. float32 = {kDLFloat, 32, 1}, bfloat16 = {kDLBfloat, 16, 1}. */
typedef struct {
    uint8_t code;    /* a DLDataTypeCode */
    uint8_t bits;    /* bits per lane    */
    uint16_t lanes;  /* 1 for scalars    */
} DLDataType;

/* A strided view of memory; owns nothing. */
typedef struct {
    void *data;             /* base pointer (device pointer for CUDA)  */
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;         /* ndim entries                            */
    int64_t *strides;       /* ndim entries in elements, or NULL       */
    uint64_t byte_offset;   /* bytes from data to the first element    */
} DLTensor;

/* Legacy (pre-1.0) managed tensor: capsule name "dltensor". */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;                              /* producer's context   */
    void (*deleter)(struct DLManagedTensor *self);  /* may be NULL          */
} DLManagedTensor;

/* Versioned managed tensor (DLPack >= 1.0): capsule "dltensor_versioned". */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;          /* DLPACK_FLAG_BITMASK_* */
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The DLPack C exchange API (DLPack 1.3): a producer's array type carries
 * `__dlpack_c_exchange_api__`, a capsule named "dlpack_exchange_api" holding a
 * pointer to this table (static in the producer, alive for the process), so a
 * C consumer can take an array and the producer's current stream without a
 * Python call. Only the members flashqla calls are typed; the others are kept
 * as opaque pointers so the layout matches. `version.major` must be 1;
 * `prev_api` chains older tables. */
#define DLPACK_EXCHANGE_API_ATTR "__dlpack_c_exchange_api__"
#define DLPACK_EXCHANGE_API_CAPSULE_NAME "dlpack_exchange_api"

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    /* an owning DLManagedTensorVersioned (flags included; the consumer calls
     * its deleter), no stream synchronisation; -1 with a Python exception set */
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    void *managed_tensor_to_py_object_no_sync;
    /* a non-owning DLTensor filled in place (shape, strides and data stay the
     * producer's, valid while the object lives and control has not returned);
     * may be NULL; -1 with a Python exception set */
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    /* the producer's current work stream on that device (NULL for the CPU) */
    int (*current_work_stream)(DLDeviceType device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

#ifdef __cplusplus
}
#endif

#endif /* FQ_DLPACK_H */
