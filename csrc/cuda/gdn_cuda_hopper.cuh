/*
 * gdn_cuda_hopper.cuh — the Hopper (sm_90a) instructions flashqla uses, as
 * inline-PTX wrappers, and nothing else: wgmma (warpgroup matrix multiply)
 * with its shared-memory descriptors, mbarrier, TMA tile loads
 * (cp.async.bulk.tensor), stmatrix, the async-proxy fence and setmaxnreg, and
 * on the host the encoding of the tensor maps TMA reads. Every wrapper compiles to nothing outside sm_90a
 * (__CUDA_ARCH_FEAT_SM90_ALL), so the compute_80 PTX fallback build stays
 * valid; kernels that use them run only where the sm_90a code does (the
 * launchers check the PTX version of the loaded kernel).
 *
 * Conventions (PTX ISA, "asynchronous warpgroup level matrix multiply"):
 *
 * Shared-memory tiles are 1024-byte aligned and laid out as TMA writes them
 * with CU_TENSOR_MAP_SWIZZLE_128B: rows of 128 bytes (64 bf16), the 16-byte
 * chunk j of row r stored at chunk j ^ (r & 7) of that row (fq_sw128). The
 * same bytes serve as a wgmma operand in either major-ness:
 *   K-major  (the row is along the reduction dim K): tile [MN rows][64 K];
 *            8-row groups 1024 B apart (SBO = 1024); the K-step k (16
 *            elements, 32 B) starts at +32 k within the 128-byte row.
 *   MN-major (the row is along M or N): tile [K rows][64 MN]; 8-row groups
 *            of K 1024 B apart (SBO = 1024), the next 64 MN elements in the
 *            tile LBO bytes away; the K-step k starts at +2048 k.
 * wgmma's imm-trans-{a,b} = 1 selects MN-major.
 *
 * Register fragments (each warp w of the warpgroup owns rows 16w..16w+15;
 * lane = 4 g + t):
 *   accumulator m64nN f32, n8 block i:  d[4i+0] = D[g][8i+2t], d[4i+1] = D[g][8i+2t+1],
 *                                       d[4i+2] = D[g+8][8i+2t], d[4i+3] = D[g+8][8i+2t+1]
 *   A m64k16 bf16 (4 x b32):  a[0] = A[g][2t,2t+1], a[1] = A[g+8][2t,2t+1],
 *                             a[2] = A[g][2t+8,+9], a[3] = A[g+8][2t+8,+9]
 * so the accumulator's n8 blocks 2k, 2k+1, packed to bf16 pairs, are the A
 * fragment of K-step k of the next product (fq_acc_to_a).
 */
#ifndef FQ_GDN_CUDA_HOPPER_CUH
#define FQ_GDN_CUDA_HOPPER_CUH

#include "gdn_cuda_common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FQ_SM90A 1
#else
#define FQ_SM90A 0
#endif

/* ------------------------------------------------------------- swizzle ---- */

#define FQ_TILE 8192 /* one 64 x 64 bf16 SWIZZLE_128B tile */

/* Byte offset of (row, byte b within the 128-byte row) in a SWIZZLE_128B tile. */
static __device__ __forceinline__ uint32_t fq_sw128(int row, int b)
{
    return (uint32_t)(row * 128 + (b ^ ((row & 7) << 4)));
}

/* wgmma shared-memory matrix descriptor, no swizzle (layout type 0): the
 * operand as 8 x 8 core matrices (8 rows of 16 bytes, 128 bytes contiguous);
 * start address, lbo = the byte offset between core matrices adjacent in K,
 * sbo = between core matrices adjacent in M or N (each >> 4 in its 14-bit
 * field). */
static __device__ __forceinline__ uint64_t fq_desc_interleave(uint32_t saddr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32);
}

/* The same fields with SWIZZLE_128B (layout type 1). */
static __device__ __forceinline__ uint64_t fq_desc_sw128(uint32_t saddr, uint32_t lbo, uint32_t sbo)
{
    return fq_desc_interleave(saddr, lbo, sbo) | (1ull << 62);
}

/* A descriptor moved by `bytes` (a multiple of 16): the start address is the
 * low 14-bit field, and no tile crosses 256 KB, so the field cannot carry. */
static __device__ __forceinline__ uint64_t fq_desc_at(uint64_t d, uint32_t bytes)
{
    return d + (bytes >> 4);
}

/* bf16 pair at (row, column col, col + 1) of a 64-column tile */
static __device__ __forceinline__ uint32_t *fq_tile_pair(unsigned char *tile, int row, int col)
{
    return (uint32_t *)(tile + fq_sw128(row, 2 * col));
}

/* 32 bits at a shared-memory address (fq_smem_u32's form): a swizzled address built by
 * XOR once per row, which the compiler would otherwise recompute (or spill) per element */
static __device__ __forceinline__ uint32_t fq_lds_u32(uint32_t addr)
{
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
    return v;
}

/* Descriptors of operands in 64 x 64 tiles: K-major (lbo 16, sbo 1024; the
 * K-step kk of a product over 64 KT columns at (kk / 4) tiles + 32 (kk % 4)
 * bytes, fq_koff) and MN-major (the next 64 M/N elements a tile away, sbo
 * 1024; K-step kk at 2048 kk bytes). */
static __device__ __forceinline__ uint64_t fq_dkm(const unsigned char *p)
{
    return fq_desc_sw128(fq_smem_u32(p), 16, 1024);
}
static __device__ __forceinline__ uint64_t fq_dmn(const unsigned char *p)
{
    return fq_desc_sw128(fq_smem_u32(p), FQ_TILE, 1024);
}
static __device__ __forceinline__ uint32_t fq_koff(int kk) { return (kk >> 2) * FQ_TILE + 32 * (kk & 3); }

/* ------------------------------------------------------------ warpgroup ---- */

static __device__ __forceinline__ void fq_wgmma_fence(void)
{
#if FQ_SM90A
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void fq_wgmma_commit(void)
{
#if FQ_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> static __device__ __forceinline__ void fq_wgmma_wait(void)
{
#if FQ_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
/* The accumulator registers are "+f" operands of the asm; after a wait the
 * compiler must not move their uses above it: fq_reg_fence(acc) ties them. */
template <int NR> static __device__ __forceinline__ void fq_reg_fence(float (&d)[NR])
{
#pragma unroll
    for (int i = 0; i < NR; i++) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N> static __device__ __forceinline__ void fq_setmaxnreg_inc(void)
{
#if FQ_SM90A
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N) : "memory");
#endif
}
template <int N> static __device__ __forceinline__ void fq_setmaxnreg_dec(void)
{
#if FQ_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N) : "memory");
#endif
}

/* Generic-proxy writes to shared memory made visible to the async proxy
 * (wgmma operand reads, TMA): each writing thread, before the barrier that
 * orders the writes with the reader. */
static __device__ __forceinline__ void fq_fence_async_smem(void)
{
#if FQ_SM90A
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/* Accumulator n8 blocks 2k, 2k+1 -> the bf16 A fragment of K-step k. */
static __device__ __forceinline__ void fq_acc_to_a(uint32_t a[4], const float *d8, float s)
{
    a[0] = fq_pack_bf16(d8[0] * s, d8[1] * s);
    a[1] = fq_pack_bf16(d8[2] * s, d8[3] * s);
    a[2] = fq_pack_bf16(d8[4] * s, d8[5] * s);
    a[3] = fq_pack_bf16(d8[6] * s, d8[7] * s);
}

/* ------------------------------------------------------------------ wgmma ----
 * D (m64 x N, f32) (+)= A (m64 x k16, bf16) B (k16 x N, bf16).
 *   _ss: A and B from shared memory (descriptors), trans_a/trans_b: 0 K-major,
 *        1 MN-major;
 *   _rs: A from registers (4 x b32 bf16 pairs), B from shared memory;
 *   acc = 0: D = A B (the accumulator is overwritten), 1: D += A B;
 *   NEG_A = 1: D (+)= -A B (imm-scale-a = -1). */

#define FQ_D8(i) "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                 "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

template <int TA, int TB>
static __device__ __forceinline__ void fq_wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int acc)
{
#if FQ_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : FQ_D8(0), FQ_D8(8), FQ_D8(16), FQ_D8(24)
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
#endif
}

template <int TA, int TB>
static __device__ __forceinline__ void fq_wgmma_ss_n32(float (&d)[16], uint64_t da, uint64_t db, int acc)
{
#if FQ_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "%16, %17, p, 1, 1, %19, %20;\n}\n"
        : FQ_D8(0), FQ_D8(8)
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
#endif
}

template <int TA, int TB, int NEG_A>
static __device__ __forceinline__ void fq_wgmma_ss_n128(float (&d)[64], uint64_t da, uint64_t db, int acc)
{
#if FQ_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "%64, %65, p, %67, 1, %68, %69;\n}\n"
        : FQ_D8(0), FQ_D8(8), FQ_D8(16), FQ_D8(24), FQ_D8(32), FQ_D8(40), FQ_D8(48), FQ_D8(56)
        : "l"(da), "l"(db), "r"(acc), "n"(NEG_A ? -1 : 1), "n"(TA), "n"(TB));
#endif
}

template <int TB, int NEG_A>
static __device__ __forceinline__ void fq_wgmma_rs_n64(float (&d)[32], const uint32_t a[4], uint64_t db, int acc)
{
#if FQ_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, p, %38, 1, %39;\n}\n"
        : FQ_D8(0), FQ_D8(8), FQ_D8(16), FQ_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(NEG_A ? -1 : 1), "n"(TB));
#endif
}

template <int TB, int NEG_A>
static __device__ __forceinline__ void fq_wgmma_rs_n128(float (&d)[64], const uint32_t a[4], uint64_t db, int acc)
{
#if FQ_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, p, %70, 1, %71;\n}\n"
        : FQ_D8(0), FQ_D8(8), FQ_D8(16), FQ_D8(24), FQ_D8(32), FQ_D8(40), FQ_D8(48), FQ_D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(NEG_A ? -1 : 1), "n"(TB));
#endif
}
#undef FQ_D8

/* acc = A B^T over K (a fresh accumulator), A and B two 64-row K-major
 * operands of K/64 SWIZZLE_128B tiles from descriptors da, db: Q K^T, Q S. */
template <int K>
static __device__ __forceinline__ void fq_wgmma_ss_qk(float (&acc)[32], uint64_t da, uint64_t db)
{
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        const uint32_t off = (kk >> 2) * FQ_TILE + 32 * (kk & 3);
        fq_wgmma_ss_n64<0, 0>(acc, fq_desc_at(da, off), fq_desc_at(db, off), kk > 0);
    }
}

/* The A fragment of K-step kk of a 64-row operand stored MN-major in one
 * SWIZZLE_128B tile [k][m] (e.g. dO^T from a dO tile [r][v]: m = v, k = r), for
 * warp w of the warpgroup (rows m = 16 w ..), by ldmatrix.trans. */
static __device__ __forceinline__ void fq_frag_a_mn(uint32_t (&a)[4], const unsigned char *tile, int kk, int w,
                                                    int lane)
{
    const int m = lane >> 3, rr = 16 * kk + (lane & 7) + 8 * (m >> 1);
    fq_ldsm_x4_trans(a, fq_smem_u32(tile + fq_sw128(rr, 2 * (16 * w + 8 * (m & 1)))));
}

/* That fragment's K-index pairs (k = 16 kk + 2 t, +1; and + 8) scaled by a
 * 64-float vector: A diag(vec) for K-step kk. */
static __device__ __forceinline__ void fq_frag_a_scale_k(uint32_t (&a)[4], const float *vec, int kk, int t)
{
    const float2 f0 = *(const float2 *)(vec + 16 * kk + 2 * t);
    const float2 f8 = *(const float2 *)(vec + 16 * kk + 8 + 2 * t);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const float2 x = fq_unpack_bf16(a[q]);
        const float2 f = q < 2 ? f0 : f8;
        a[q] = fq_pack_bf16(x.x * f.x, x.y * f.y);
    }
}

/* Four 8x8 b16 matrices from registers to shared memory (stmatrix): lane l
 * gives the address of row l % 8 of matrix l / 8; r[i] holds the thread's
 * pair of matrix i in the accumulator layout (row g, columns 2t, 2t+1).
 * _t: each matrix stored transposed (that pair goes to rows 2t, 2t+1 of
 * column g). */
static __device__ __forceinline__ void fq_stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3)
{
#if FQ_SM90A
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
#endif
}
static __device__ __forceinline__ void fq_stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3)
{
#if FQ_SM90A
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
#endif
}

/* Lane l's stmatrix / ldmatrix address for accumulator n8 blocks nb0, nb0 + 1
 * of warp w (16 rows) in a 64 x 64 bf16 SWIZZLE_128B tile whose rows are the
 * accumulator's rows, columns 8 nb: row l % 8 of matrix l / 8 = (block
 * nb0 + l / 16, rows + 8 ((l / 8) % 2)). */
static __device__ __forceinline__ uint32_t fq_pair_addr(const unsigned char *tile, int w, int nb0, int l)
{
    const int i = l >> 3;
    const int row = 16 * w + 8 * (i & 1) + (l & 7), nb = nb0 + (i >> 1);
    return fq_smem_u32(tile + fq_sw128(row, 16 * (nb & 7)));
}

/* Accumulator n8 blocks nb0, nb0 + 1 of warp w as bf16 pairs p<nb><h> (h:
 * rows + 8) into such a tile: one stmatrix (ldmatrix at the same address
 * gives the pairs back, fq_acc_to_a's A fragment). */
static __device__ __forceinline__ void fq_stsm_pairs(unsigned char *tile, int w, int nb0, uint32_t p00, uint32_t p01,
                                                     uint32_t p10, uint32_t p11)
{
    fq_stsm_x4(fq_pair_addr(tile, w, nb0, threadIdx.x & 31), p00, p01, p10, p11);
}

/* --------------------------------------------------------------- mbarrier ---- */

static __device__ __forceinline__ void fq_mbar_init(uint64_t *bar, int count)
{
#if FQ_SM90A
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(fq_smem_u32(bar)), "r"(count) : "memory");
#endif
}
/* Makes initialised barriers visible to the async proxy (TMA); then a
 * block-wide barrier before any use. */
static __device__ __forceinline__ void fq_mbar_init_fence(void)
{
#if FQ_SM90A
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void fq_mbar_arrive(uint64_t *bar)
{
#if FQ_SM90A
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(fq_smem_u32(bar)) : "memory");
#endif
}
/* One arrival that also announces `bytes` of TMA transactions. */
static __device__ __forceinline__ void fq_mbar_arrive_tx(uint64_t *bar, uint32_t bytes)
{
#if FQ_SM90A
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(fq_smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
#endif
}
/* Waits until the barrier's phase with the given parity has completed. */
static __device__ __forceinline__ void fq_mbar_wait(uint64_t *bar, uint32_t parity)
{
#if FQ_SM90A
    asm volatile(
        "{\n.reg .pred ok;\n"
        "FQ_MBAR_WAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 ok, [%0], %1;\n"
        "@!ok bra FQ_MBAR_WAIT_%=;\n}\n" ::"r"(fq_smem_u32(bar)),
        "r"(parity)
        : "memory");
#endif
}

/* -------------------------------------------------------------------- TMA ---- */

/* Tile load global -> shared through a tensor map (a __grid_constant__
 * kernel parameter), completing `bar`'s transactions. Coordinates innermost
 * first, in elements. */
static __device__ __forceinline__ void fq_tma_load_2d(void *dst, const void *tmap, uint64_t *bar, int c0, int c1)
{
#if FQ_SM90A
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
            fq_smem_u32(dst)),
        "l"((uint64_t)tmap), "r"(fq_smem_u32(bar)), "r"(c0), "r"(c1)
        : "memory");
#endif
}
static __device__ __forceinline__ void fq_tma_load_3d(void *dst, const void *tmap, uint64_t *bar, int c0, int c1,
                                                      int c2)
{
#if FQ_SM90A
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];\n" ::"r"(fq_smem_u32(dst)),
        "l"((uint64_t)tmap), "r"(fq_smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
#endif
}
/* Contiguous bulk copy global -> shared of `bytes` (a multiple of 16, both
 * addresses 16-byte aligned), completing `bar`'s transactions. */
static __device__ __forceinline__ void fq_bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
#if FQ_SM90A
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     fq_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(fq_smem_u32(bar))
                 : "memory");
#endif
}

/* Tile store shared -> global through a tensor map (bulk async group), then
 * the group bookkeeping: _read waits until the shared-memory source may be
 * reused, the plain wait until the global writes are done. */
static __device__ __forceinline__ void fq_tma_store_3d(const void *tmap, const void *src, int c0, int c1, int c2)
{
#if FQ_SM90A
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     (uint64_t)tmap),
                 "r"(fq_smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
#endif
}
static __device__ __forceinline__ void fq_bulk_commit(void)
{
#if FQ_SM90A
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
/* wait until at most N committed bulk groups may still read their shared-memory sources */
template <int N> static __device__ __forceinline__ void fq_bulk_wait_read(void)
{
#if FQ_SM90A
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
static __device__ __forceinline__ void fq_bulk_wait0(void)
{
#if FQ_SM90A
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}
/* Orders this thread's earlier generic-proxy view of global memory (an
 * acquire, say) before its later async-proxy accesses (TMA, bulk copies). */
static __device__ __forceinline__ void fq_fence_proxy_async_global(void)
{
#if FQ_SM90A
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void fq_tma_prefetch_desc(const void *tmap)
{
#if FQ_SM90A
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)tmap) : "memory");
#endif
}

/* ------------------------------------------------- tensor maps (host) ---- */

#include <cuda.h> /* CUtensorMap and its enums only: the encoder comes from the runtime */

typedef CUresult (*fq_encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                       const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled from the driver, through the runtime (no libcuda
 * link), looked up once. */
static inline fq_status fq_encoder(fq_encode_tiled_fn *fn)
{
    static fq_encode_tiled_fn cached = NULL;
    if (!cached) {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        FQ_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !f)
            return fq_fail(FQ_ERR_CUDA, "the CUDA driver has no cuTensorMapEncodeTiled (driver too old?)");
        cached = (fq_encode_tiled_fn)f;
    }
    *fn = cached;
    return FQ_OK;
}

/* A bf16 (fp16) tensor map over rank dims (innermost first, elements) with the
 * given strides (bytes, dims 1..), 64 x ... boxes, SWIZZLE_128B. */
static inline fq_status fq_tmap(CUtensorMap *m, const void *base, int rank, const uint64_t *dims, const uint64_t *strides,
                         const uint32_t *box, int fp16 = 0)
{
    fq_encode_tiled_fn enc;
    fq_status st = fq_encoder(&enc);
    if (st != FQ_OK) return st;
    cuuint64_t d[3], sb[2];
    cuuint32_t bx[3], es[3] = {1, 1, 1};
    for (int i = 0; i < rank; i++) { d[i] = dims[i]; bx[i] = box[i]; }
    for (int i = 0; i < rank - 1; i++) sb[i] = strides[i];
    CUresult r = enc(m, fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)base, d, sb, bx, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return fq_fail(FQ_ERR_CUDA, "cuTensorMapEncodeTiled failed (%d)", (int)r);
    return FQ_OK;
}

#endif /* FQ_GDN_CUDA_HOPPER_CUH */
