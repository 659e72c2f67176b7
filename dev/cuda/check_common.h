/*
 * check_common.h — what the standalone CUDA check drivers in dev/cuda/ share:
 * the exit-on-error check of CUDA calls (fine in a test program, never in the
 * library, whose macro returns a status) and a small xorshift generator.
 */
#ifndef FQ_DEV_CHECK_COMMON_H
#define FQ_DEV_CHECK_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#define CK(call)                                                                         \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(2);                                                                     \
        }                                                                                \
    } while (0)

/* xorshift64; urand in (0, 1), nrand standard normal (Box-Muller) */
static uint64_t fq_dev_rng = 0x9E3779B97F4A7C15ull;
static inline double urand(void)
{
    fq_dev_rng ^= fq_dev_rng << 13; fq_dev_rng ^= fq_dev_rng >> 7; fq_dev_rng ^= fq_dev_rng << 17;
    return ((fq_dev_rng >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static inline double nrand(void) { return sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand()); }

#endif /* FQ_DEV_CHECK_COMMON_H */
