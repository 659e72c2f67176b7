/*
 * gdn_cpu_dispatch.c — which kernel set the CPU backend runs (fq_cpu_isa in
 * gdn.h, fq_cpu_kernels_get in gdn_cpu.h).
 *
 * Chosen once per process, at the first CPU call:
 *   FLASHQLA_CPU_ISA unset, "" or "auto": the best set this CPU runs:
 *     x86-64   avx512 (AVX-512 F/BW/DQ/VL with the OS saving zmm state),
 *              else avx2 (AVX2 + FMA + F16C with the OS saving ymm state),
 *              else scalar; read from cpuid at run time;
 *     AArch64  neon (always present there; fixed at build time);
 *     others   scalar.
 *   FLASHQLA_CPU_ISA=avx512 | avx2 | neon | scalar: that set, if this build
 *     has it and this CPU runs it; otherwise every CPU call fails with
 *     FQ_ERR_UNSUPPORTED naming what it can run (an unknown name:
 *     FQ_ERR_VALUE). Nothing is ever run that the CPU cannot execute.
 */
#include "gdn_cpu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FQ_X86 1
#else
#define FQ_X86 0
#endif

/* ------------------------------------------------ what this CPU runs ---- */

enum { FQ_HAS_AVX2 = 1, FQ_HAS_AVX512 = 2 };

#if FQ_X86
/* AVX2 set: AVX, AVX2, FMA, F16C, and XCR0 with SSE and AVX state (bits 1, 2).
 * AVX-512 set: also AVX-512 F, DQ, BW, VL and XCR0's opmask and zmm state
 * (bits 5, 6, 7). */
static int x86_features(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx && fma && f16c)) return 0;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 0x6u) != 0x6u) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    int f = 0;
    if ((b >> 5) & 1) f |= FQ_HAS_AVX2;
    const int f512 = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    if ((f & FQ_HAS_AVX2) && f512 && dq && bw && vl && (xlo & 0xe6u) == 0xe6u) f |= FQ_HAS_AVX512;
    return f;
}
#endif

typedef struct {
    const char *name;
    const fq_cpu_kernels *kern; /* NULL: not in this build */
    int runs;                   /* this CPU runs it */
    const char *needs;          /* what it needs, for the message */
} fq_isa_entry;

/* best first */
static int isa_table(fq_isa_entry *t)
{
    int n = 0;
#if FQ_X86
    const int f = x86_features();
    t[n++] = (fq_isa_entry){"avx512", fq_cpu_kernels_avx512, (f & FQ_HAS_AVX512) != 0,
                            "AVX-512 F/BW/DQ/VL on x86-64"};
    t[n++] = (fq_isa_entry){"avx2", fq_cpu_kernels_avx2, (f & FQ_HAS_AVX2) != 0,
                            "AVX2, FMA and F16C on x86-64"};
#endif
    t[n++] = (fq_isa_entry){"neon", fq_cpu_kernels_neon, fq_cpu_kernels_neon != NULL,
                            "an AArch64 build"};
    t[n++] = (fq_isa_entry){"scalar", fq_cpu_kernels_scalar, 1, "nothing"};
    return n;
}

/* ------------------------------------------------------------ choice ---- */

static pthread_once_t choice_once = PTHREAD_ONCE_INIT;
static const fq_cpu_kernels *chosen;
static fq_status choice_status = FQ_OK;
static char choice_error[320];

static void choose(void)
{
    fq_isa_entry t[4];
    const int n = isa_table(t);
    const char *want = getenv("FLASHQLA_CPU_ISA");
    char can[64] = "";
    for (int i = 0; i < n; i++)
        if (t[i].kern && t[i].runs) {
            if (can[0]) strncat(can, ", ", sizeof can - strlen(can) - 1);
            strncat(can, t[i].name, sizeof can - strlen(can) - 1);
        }
    if (!want || !*want || strcmp(want, "auto") == 0) {
        for (int i = 0; i < n && !chosen; i++)
            if (t[i].kern && t[i].runs) chosen = t[i].kern;
        return; /* scalar always qualifies */
    }
    for (int i = 0; i < n; i++) {
        if (strcmp(want, t[i].name) != 0) continue;
        if (t[i].kern && t[i].runs) {
            chosen = t[i].kern;
            return;
        }
        choice_status = FQ_ERR_UNSUPPORTED;
        snprintf(choice_error, sizeof choice_error,
                 "FLASHQLA_CPU_ISA=%s: %s (it needs %s); this CPU and build can run: %s",
                 want, t[i].kern ? "this CPU cannot run it" : "this build does not have it",
                 t[i].needs, can);
        return;
    }
    choice_status = FQ_ERR_VALUE;
    snprintf(choice_error, sizeof choice_error,
             "FLASHQLA_CPU_ISA=%.40s: expected auto, avx512, avx2, neon or scalar "
             "(this CPU and build can run: %s)", want, can);
}

fq_status fq_cpu_kernels_get(const fq_cpu_kernels **out)
{
    pthread_once(&choice_once, choose);
    if (!chosen) return fq_fail(choice_status, "%s", choice_error);
    *out = chosen;
    return FQ_OK;
}

fq_status fq_cpu_isa(const char **name)
{
    const fq_cpu_kernels *k = NULL;
    fq_status st = fq_cpu_kernels_get(&k);
    if (st != FQ_OK) return st;
    *name = k->isa;
    return FQ_OK;
}
