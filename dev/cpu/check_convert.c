/* check_convert.c — exhaustive check of the fp16/bf16 conversions of gdn_cpu.h
 * against the compiler's _Float16 (GCC >= 12 on x86 and AArch64) and a
 * double-based bf16 rounding; then the active kernel set's tile loads and
 * stores (vector conversions, FLASHQLA_CPU_ISA picks the set) against those
 * scalar conversions, bit for bit (NaN: stays NaN).
 *   make -C dev check_convert          every 7th float
 *   dev/build/check_convert STRIDE     every STRIDE-th float (qemu: fewer) */
#include "cpu/gdn_cpu.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* the kernel set's load_row / store_row against the scalar conversions, on
 * rows of 61 elements (vector body and scalar tail) at offset 3 */
static long check_rows(uint64_t stride)
{
    const fq_cpu_kernels *k;
    if (fq_cpu_kernels_get(&k) != FQ_OK) {
        printf("kernel set: %s\n", fq_last_error());
        return 1;
    }
    enum { N = 61, OFF = 3 };
    long bad = 0;
    uint16_t h[OFF + N], out16[OFF + N];
    float f[N], got[N];
    for (uint32_t h0 = 0; h0 < 65536; h0 += N) { /* half -> float, every half */
        for (int i = 0; i < N; i++) h[OFF + i] = (uint16_t)(h0 + (uint32_t)i);
        for (int d = 0; d < 2; d++) {
            const fq_dtype dt = d ? FQ_BF16 : FQ_F16;
            k->load_row(got, h, dt, OFF, N);
            for (int i = 0; i < N; i++) {
                float ref = d ? fq_cpu_bf16_to_f32(h[OFF + i]) : fq_cpu_f16_to_f32(h[OFF + i]);
                if (isnan(ref) ? !isnan(got[i]) : fq_cpu_f32_to_bits(got[i]) != fq_cpu_f32_to_bits(ref)) {
                    if (bad < 5) printf("%s load %04x: got %08x\n", d ? "bf16" : "f16", h[OFF + i],
                                        fq_cpu_f32_to_bits(got[i]));
                    bad++;
                }
            }
        }
    }
    for (uint64_t u = 0; u < (1ull << 32); u += stride * N) { /* float -> half */
        for (int i = 0; i < N; i++) f[i] = fq_cpu_bits_to_f32((uint32_t)(u + (uint64_t)i * stride));
        for (int d = 0; d < 2; d++) {
            const fq_dtype dt = d ? FQ_BF16 : FQ_F16;
            k->store_row(out16, dt, OFF, f, N);
            for (int i = 0; i < N; i++) {
                uint16_t ref = d ? fq_cpu_f32_to_bf16(f[i]) : fq_cpu_f32_to_f16(f[i]);
                float back = d ? fq_cpu_bf16_to_f32(out16[OFF + i]) : fq_cpu_f16_to_f32(out16[OFF + i]);
                if (isnan(f[i]) ? !isnan(back) : out16[OFF + i] != ref) {
                    if (bad < 5) printf("%s store %08x: got %04x ref %04x\n", d ? "bf16" : "f16",
                                        fq_cpu_f32_to_bits(f[i]), out16[OFF + i], ref);
                    bad++;
                }
            }
        }
    }
    printf("kernel set %s: tile load/store mismatches: %ld\n", k->isa, bad);
    return bad;
}

int main(int argc, char **argv)
{
    const uint64_t stride = argc > 1 ? strtoull(argv[1], NULL, 10) : 7;
    if (stride < 1) return 2;
    long bad = 0;
    for (uint32_t h = 0; h < 65536; h++) { /* f16 -> f32 exact */
        _Float16 x; uint16_t hh = (uint16_t)h; memcpy(&x, &hh, 2);
        float a = fq_cpu_f16_to_f32(hh), b = (float)x;
        if (!(a == b || (isnan(a) && isnan(b))) || fq_cpu_f32_to_bits(a) != fq_cpu_f32_to_bits(b)) {
            if (!(isnan(a) && isnan(b))) bad++;
        }
    }
    for (uint64_t u = 0; u < (1ull << 32); u += stride) { /* f32 -> f16, f32 -> bf16 */
        float f = fq_cpu_bits_to_f32((uint32_t)u);
        _Float16 x = (_Float16)f; uint16_t ref; memcpy(&ref, &x, 2);
        uint16_t got = fq_cpu_f32_to_f16(f);
        if (isnan(f)) {
            if ((got & 0x7c00) != 0x7c00 || (got & 0x3ff) == 0) bad++;
        } else if (got != ref) {
            if (bad < 5) printf("f16 %08x: got %04x ref %04x\n", (uint32_t)u, got, ref);
            bad++;
        }
        uint16_t bg = fq_cpu_f32_to_bf16(f);
        if (isnan(f)) { if (!isnan(fq_cpu_bf16_to_f32(bg))) bad++; }
        else {
            /* reference: nearest of the two bf16 neighbours, ties to even */
            uint32_t lo = (uint32_t)u & 0xffff0000u, rem = (uint32_t)u & 0xffffu;
            uint32_t r = lo >> 16;
            if (rem > 0x8000u || (rem == 0x8000u && (r & 1))) r++;
            if ((uint16_t)r != bg) { if (bad < 5) printf("bf16 %08x\n", (uint32_t)u); bad++; }
        }
    }
    printf("conversion mismatches: %ld\n", bad);
    bad += check_rows(stride);
    return bad != 0;
}
