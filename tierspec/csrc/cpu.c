/* The CPU's features, read once at import into ``cpu``: what CPUID lists, what the OS saves (XCR0),
 * for AMX the Linux permission and a tile product tried once in a forked child; the cap
 * TIERSPEC_ENGINE_ISA parsed strictly; and the kernel table composed from every path up to the
 * level in use.
 *
 * Why each check: a CPU can list AVX-512 or AMX while the OS does not save their registers (then
 * the instructions fault, or corrupt state across context switches); Linux grants AMX's tile data
 * only on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); and a VM can list AMX in
 * CPUID yet fault on its instructions (llama.cpp built with AMX died with SIGILL at ``tilezero`` on
 * one of this project's machines). The child tries what the kernels will do (ldtilecfg, tilezero,
 * tileloadd, tdpbf16ps, tdpbsud, tilestored) and checks the numbers, so a fault kills the child,
 * never the process, and the reason is kept for the report. */
#define _GNU_SOURCE /* syscall, arch_prctl */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#if QE_X86 && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

const char *const isa_names[ISAS] = {"portable", "avx2", "avx512", "avx512vnni", "avx512bf16", "amx"};

cpu_features cpu;
kernel_set kernels;

int isa_by_name(const char *name) {
    for (int i = 0; i < ISAS; i++)
        if (strcmp(name, isa_names[i]) == 0) return i;
    return -1;
}

#if QE_X86 && defined(__GNUC__)
static uint64_t read_xcr0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}
#endif

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* AMX's last checks, with the reason kept where one fails. */
static int amx_usable(void) {
    if (!(cpu.amx_tile && cpu.amx_bf16 && cpu.amx_int8)) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "this CPU's CPUID lists no AMX (tiles with BF16 and INT8)");
        return 0;
    }
    if (cpu.best < ISA_AVX512BF16) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "AMX is listed but AVX512-BF16 or the OS's AVX-512 state is not");
        return 0;
    }
    if (!cpu.os_tiles) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "the OS does not enable the tile state (XCR0 bits 17-18)");
        return 0;
    }
#if defined(__linux__) && QE_X86
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "Linux refused the tile data (arch_prctl ARCH_REQ_XCOMP_PERM: %s)",
                 strerror(errno));
        return 0;
    }
    unsigned long long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0 || !(granted & (1ull << XFEATURE_XTILEDATA))) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "Linux did not grant the tile data (ARCH_GET_XCOMP_PERM)");
        return 0;
    }
    fflush(NULL); /* the child must not write the parent's buffered output again */
    pid_t child = fork();
    if (child < 0) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "could not fork the AMX probe (%s)", strerror(errno));
        return 0;
    }
    if (child == 0) _exit(amx_selftest() ? 0 : 2);
    int status = 0;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) {
            snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "lost the AMX probe's child (%s)", strerror(errno));
            return 0;
        }
    if (WIFSIGNALED(status)) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "a tile instruction killed the probe (signal %d%s)", WTERMSIG(status),
                 WTERMSIG(status) == 4 ? ", SIGILL: the VM or OS does not run AMX" : "");
        return 0;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "a tile product gave wrong numbers in the probe");
        return 0;
    }
    cpu.amx_reason[0] = 0;
    return 1;
#else
    snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "AMX is used on Linux x86-64 only");
    return 0;
#endif
}

int cpu_init(char *error, size_t size) {
    memset(&cpu, 0, sizeof cpu);
    const char *cap = getenv("TIERSPEC_ENGINE_ISA");
    cpu.cap = ISA_AMX;
    if (cap && *cap) {
        cpu.cap = isa_by_name(cap);
        cpu.cap_set = 1;
        if (cpu.cap < 0) {
            int at = snprintf(error, size, "TIERSPEC_ENGINE_ISA=%s is not a kernel path; use one of:", cap);
            for (int i = 0; i < ISAS && at > 0 && (size_t)at < size; i++)
                at += snprintf(error + at, size - (size_t)at, " %s", isa_names[i]);
            return -1;
        }
    }
#if QE_X86 && defined(__GNUC__)
    unsigned a, b, c, d;
    int osxsave = 0, avx = 0;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        cpu.fma = (c >> 12) & 1;
        osxsave = (c >> 27) & 1;
        avx = (c >> 28) & 1;
        cpu.f16c = (c >> 29) & 1;
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        cpu.avx2 = (b >> 5) & 1;
        cpu.avx512f = (b >> 16) & 1;
        cpu.avx512dq = (b >> 17) & 1;
        cpu.avx512cd = (b >> 28) & 1;
        cpu.avx512bw = (b >> 30) & 1;
        cpu.avx512vl = (b >> 31) & 1;
        cpu.avx512vnni = (c >> 11) & 1;
        cpu.amx_bf16 = (d >> 22) & 1;
        cpu.amx_tile = (d >> 24) & 1;
        cpu.amx_int8 = (d >> 25) & 1;
    }
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) cpu.avx512bf16 = (a >> 5) & 1;
    if (osxsave && avx) {
        uint64_t xcr0 = read_xcr0();
        cpu.os_ymm = (xcr0 & 0x6) == 0x6;          /* SSE and AVX state */
        cpu.os_zmm = (xcr0 & 0xe6) == 0xe6;        /* + opmask, ZMM_Hi256, Hi16_ZMM */
        cpu.os_tiles = (xcr0 & 0x60000) == 0x60000; /* XTILECFG and XTILEDATA */
    }
    cpu.best = ISA_PORTABLE;
    if (cpu.os_ymm && cpu.avx2 && cpu.fma && cpu.f16c) {
        cpu.best = ISA_AVX2;
        /* CD too: the keyed draw's scan (keyed_scan.h, kernel_set.keyed_max) counts leading zeros with it */
        if (cpu.os_zmm && cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512dq && cpu.avx512cd) {
            cpu.best = ISA_AVX512;
            if (cpu.avx512vnni) {
                cpu.best = ISA_AVX512VNNI;
                if (cpu.avx512bf16) cpu.best = ISA_AVX512BF16;
            }
        }
    }
    /* AMX is probed only where it would be used: a cap below it leaves the process untouched */
    if (cpu.cap >= ISA_AMX) {
        cpu.amx = amx_usable();
        if (cpu.amx) cpu.best = ISA_AMX;
    } else {
        snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "not probed: TIERSPEC_ENGINE_ISA=%s", isa_names[cpu.cap]);
    }
#else
    cpu.best = ISA_PORTABLE;
    snprintf(cpu.amx_reason, sizeof cpu.amx_reason, "not an x86-64 CPU");
#endif
    cpu.level = cpu.best < cpu.cap ? cpu.best : cpu.cap;
    select_kernels(cpu.level);
    return 0;
}

/* The kernel table for ``level``: the portable kernels, each overwritten by every path up to it
 * that provides its own. */
void select_kernels(int level) {
    kernel_set k;
    memset(&k, 0, sizeof k);
    install_portable(&k);
    k.pass_rows = PASS_ROWS;
    if (level >= ISA_AVX2) install_avx2(&k);
    if (level >= ISA_AVX512) install_avx512(&k);
    if (level >= ISA_AVX512VNNI) install_vnni(&k);
    if (level >= ISA_AVX512BF16) install_avx512bf16(&k);
    if (level >= ISA_AMX) install_amx(&k);
    kernels = k;
    cpu.level = level;
}
