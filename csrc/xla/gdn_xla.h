/*
 * gdn_xla.h — flashqla's kernels as XLA custom calls (XLA FFI handlers), for
 * JAX's jax.ffi.ffi_call. No Python and no XLA type in this header: the
 * binding (csrc/python/module.c) hands the handler pointers to Python, where
 * flashqla/jax.py registers them with jax.ffi.register_ffi_target.
 *
 * Targets (platform "cpu" or "CUDA"; XLA FFI API, custom call version 4).
 * Arguments and results in this order, those in [] present only when their
 * flag attribute is 1; every attribute is a scalar (flags int32, scale f64):
 *
 *   flashqla_chunk_fwd   args  q, k, v, g, beta, [initial_state], [cu_seqlens]
 *                        rets  o, [final_state]
 *                        attrs scale, use_qk_l2norm, has_initial_state,
 *                              has_cu_seqlens, output_final_state
 *   flashqla_chunk_bwd   args  q, k, v, g, beta, [initial_state], [cu_seqlens],
 *                              do, [dfinal_state]
 *                        rets  dq, dk, dv, dg, dbeta, [dinitial_state]
 *                        attrs scale, use_qk_l2norm, has_initial_state,
 *                              has_cu_seqlens, has_dfinal_state
 *   flashqla_recurrent   args  q, k, v, g, beta, state, [state_indices],
 *                              [cu_seqlens]
 *                        rets  o, new_state (the caller aliases it to `state`:
 *                              input_output_aliases={5: 1}; the step reads the
 *                              pool from it and updates it in place)
 *                        attrs scale, use_qk_l2norm, has_state_indices,
 *                              has_cu_seqlens
 *
 * Shapes are gdn.h's, with one freedom: leading dimensions in front of
 * [B, T, ...] and [N, HV, K, V] are folded into B and N (what jax.vmap's
 * broadcast_all batching hands over; not with cu_seqlens). The CUDA handlers
 * launch on the stream XLA hands them and take their scratch from XLA's
 * allocator for the device (XLA_FFI_DeviceMemory_Allocate): no host sync.
 */
#ifndef FQ_GDN_XLA_H
#define FQ_GDN_XLA_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *name;      /* the custom call target, e.g. "flashqla_chunk_fwd" */
    const char *platform;  /* "cpu" or "CUDA" (jax.ffi.register_ffi_target's)   */
    void *handler;         /* an XLA_FFI_Handler *                              */
} fq_xla_target;

/* The handlers this build has (*n of them; 0 when it was built without the
 * XLA FFI header, see setup.py). CUDA targets are listed only when the CUDA
 * backend is built. */
const fq_xla_target *fq_xla_targets(int *n);

/* The XLA FFI API version the handlers were compiled against ("0.3"), or ""
 * when there are none. */
const char *fq_xla_api_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FQ_GDN_XLA_H */
