/* check_convert.c — exhaustive check of the fp16/bf16 conversions of gdn_cpu.h
 * against the compiler's _Float16 (GCC >= 12 on x86) and a double-based
 * bf16 rounding.  make -C dev check_convert */
#include "cpu/gdn_cpu.h"
#include <math.h>
#include <stdio.h>

int main(void)
{
    long bad = 0;
    for (uint32_t h = 0; h < 65536; h++) { /* f16 -> f32 exact */
        _Float16 x; uint16_t hh = (uint16_t)h; memcpy(&x, &hh, 2);
        float a = fq_cpu_f16_to_f32(hh), b = (float)x;
        if (!(a == b || (isnan(a) && isnan(b))) || fq_cpu_f32_to_bits(a) != fq_cpu_f32_to_bits(b)) {
            if (!(isnan(a) && isnan(b))) bad++;
        }
    }
    for (uint64_t u = 0; u < (1ull << 32); u += 7) { /* f32 -> f16, f32 -> bf16 */
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
    return bad != 0;
}
