// A preload library that makes this process and its children see an x86-64 CPU with AVX2 and FMA
// but without AVX-512, AVX-VNNI or AMX, so that ONNX Runtime (MLAS, cpuinfo), torch (cpuinfo,
// oneDNN, MKL) and OpenBLAS pick the kernels they would pick on an AVX2-only host. Used by
// benches/avx2-host.sh for issue 15 target 7 on hosts that have AVX-512.
//
// How: Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, 0; needs the `cpuid_fault` flag in
// /proc/cpuinfo) makes every `cpuid` instruction raise SIGSEGV; the handler runs the real
// instruction with faulting briefly off, clears the masked feature bits and steps over it. The
// setting is per thread and inherited by threads and fork, so every thread of the program is
// covered. What it cannot change: XCR0 (`xgetbv`), which libraries read only beside the CPUID bits,
// and the core itself (same clocks, caches and memory as the host).
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define BIT(n) (1u << (n))

static struct sigaction previous;

static void set_cpuid_faulting(int on) { syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

// Clears what an AVX2+FMA host (Haswell to Skylake client, Zen 1-3) does not have.
static void mask(unsigned leaf, unsigned sub, unsigned r[4]) {
    if (leaf == 7 && sub == 0) {
        // EBX: AVX512F, DQ, IFMA, PF, ER, CD, BW, VL.
        r[1] &= ~(BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31));
        // ECX: AVX512_VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ.
        r[2] &= ~(BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14));
        // EDX: AVX512_4VNNIW, 4FMAPS, VP2INTERSECT, AMX_BF16, AVX512_FP16, AMX_TILE, AMX_INT8.
        r[3] &= ~(BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25));
    } else if (leaf == 7 && sub == 1) {
        // EAX: AVX_VNNI, AVX512_BF16, AMX_FP16, AVX_IFMA.
        r[0] &= ~(BIT(4) | BIT(5) | BIT(21) | BIT(23));
        // EDX: AVX_VNNI_INT8, AVX_NE_CONVERT, AVX_VNNI_INT16, AVX10.
        r[3] &= ~(BIT(4) | BIT(5) | BIT(10) | BIT(19));
    } else if (leaf == 0xd && sub == 0) {
        // The state components a CPU without AVX-512 and AMX would report: opmask, ZMM, tiles.
        r[0] &= ~(BIT(5) | BIT(6) | BIT(7) | BIT(17) | BIT(18));
    } else if (leaf == 0x1d || leaf == 0x1e || leaf == 0x24) {
        // AMX tile and AVX10 leaves.
        r[0] = r[1] = r[2] = r[3] = 0;
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *regs = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)regs[REG_RIP];
    // A faulting CPUID is a general-protection fault: SI_KERNEL, never a bad address.
    if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
        unsigned leaf = (unsigned)regs[REG_RAX], sub = (unsigned)regs[REG_RCX], r[4];
        set_cpuid_faulting(0);
        __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
        set_cpuid_faulting(1);
        mask(leaf, sub, r);
        regs[REG_RAX] = r[0];
        regs[REG_RBX] = r[1];
        regs[REG_RCX] = r[2];
        regs[REG_RDX] = r[3];
        regs[REG_RIP] += 2;
        return;
    }
    // Any other fault is the program's: hand it on, or die of it as without this library.
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, context);
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
    } else {
        signal(SIGSEGV, SIG_DFL);
    }
}

__attribute__((constructor)) static void avx2_host_init(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_segv;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGSEGV, &action, &previous) != 0 || syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {
        fprintf(stderr, "avx2_host: CPUID faulting is not available on this kernel or CPU (no cpuid_fault)\n");
        _exit(2);
    }
}
