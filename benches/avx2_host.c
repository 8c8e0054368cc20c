// A preload library that makes this process and its children see an x86-64 CPU with AVX2 and FMA
// but without AVX-512, AVX-VNNI or AMX, so that ONNX Runtime (MLAS, cpuinfo), torch (cpuinfo,
// oneDNN, MKL) and OpenBLAS pick the kernels they would pick on an AVX2-only host. Used by
// benches/avx2-host.sh for issue 15 target 7 on hosts that have AVX-512.
//
// How, where the host has CPUID faulting (arch_prctl ARCH_SET_CPUID, 0; the `cpuid_fault` flag in
// /proc/cpuinfo): every `cpuid` instruction raises SIGSEGV; the handler runs the real instruction
// with faulting briefly off, clears the masked feature bits and steps over it. The setting is per
// thread and inherited by threads and fork, so every thread of the program is covered.
// Where it has not (AVX2_HOST_PATCHED=1, set by avx2-host.sh): only copies of programs and
// libraries made by benches/avx2_patch.py are covered, whose `cpuid` instructions are `ud2`; the
// SIGILL handler answers those that lie in a file under a directory named avx2-host.
// What it cannot change: XCR0 (`xgetbv`), which libraries read only beside the CPUID bits, and the
// core itself (same clocks, caches and memory as the host).
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <fcntl.h>
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

// Answers the 2-byte instruction at RIP (a `cpuid`, faulting, or the `ud2` that replaced one) as
// `cpuid` with the masked values, and steps over it. `faulting`: CPUID faulting is on, so turned off
// around the real instruction.
static void answer_cpuid(greg_t *regs, int faulting) {
    unsigned leaf = (unsigned)regs[REG_RAX], sub = (unsigned)regs[REG_RCX], r[4];
    if (faulting) set_cpuid_faulting(0);
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    if (faulting) set_cpuid_faulting(1);
    mask(leaf, sub, r);
    regs[REG_RAX] = r[0];
    regs[REG_RBX] = r[1];
    regs[REG_RCX] = r[2];
    regs[REG_RDX] = r[3];
    regs[REG_RIP] += 2;
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *regs = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)regs[REG_RIP];
    // A faulting CPUID is a general-protection fault: SI_KERNEL, never a bad address.
    if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
        answer_cpuid(regs, 1);
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

// Reads a hexadecimal number at *p and moves *p past it.
static unsigned long hex(const char **p) {
    unsigned long v = 0;
    for (;; (*p)++) {
        char c = **p;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return v;
        v = v * 16 + (unsigned long)d;
    }
}

// Whether `ip` lies in a mapping of a file under a directory named avx2-host (a copy made by
// benches/avx2_patch.py), read from /proc/self/maps with open/read and a buffer on the stack (no
// allocation, no shared state: threads may fault at once). A line longer than the buffer (a path of
// over 4000 bytes) ends the search: not found.
static int in_patched_copy(unsigned long ip) {
    char buf[4096];
    int fd = open("/proc/self/maps", O_RDONLY);
    if (fd < 0) return 0;
    size_t have = 0;
    for (;;) {
        ssize_t n = read(fd, buf + have, sizeof buf - 1 - have);
        if (n <= 0) break;
        have += (size_t)n;
        buf[have] = 0;
        char *line = buf, *end;
        while ((end = strchr(line, '\n')) != NULL) {
            *end = 0;
            const char *q = line;
            unsigned long lo = hex(&q);
            q += *q == '-';
            unsigned long hi = hex(&q);
            if (lo <= ip && ip < hi) {
                close(fd);
                return strstr(line, "/avx2-host/") != NULL;
            }
            line = end + 1;
        }
        have = (size_t)(buf + have - line);
        memmove(buf, line, have);
    }
    close(fd);
    return 0;
}

static void on_sigill(int sig, siginfo_t *info, void *context) {
    (void)sig;
    ucontext_t *uc = context;
    greg_t *regs = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)regs[REG_RIP];
    if (info->si_code == ILL_ILLOPN && ip[0] == 0x0f && ip[1] == 0x0b && in_patched_copy((unsigned long)ip)) {
        answer_cpuid(regs, 0);
        return;
    }
    // A real ud2 (a trap): die of it as without this library.
    signal(SIGILL, SIG_DFL);
}

__attribute__((constructor)) static void avx2_host_init(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_segv;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    const char *patched = getenv("AVX2_HOST_PATCHED");
    if (patched != NULL && strcmp(patched, "1") == 0) {
        // On the faulting thread's own stack: an alternate one (Rust's is a few KiB) is too small
        // for in_patched_copy's buffer.
        action.sa_sigaction = on_sigill;
        action.sa_flags = SA_SIGINFO;
        if (sigaction(SIGILL, &action, NULL) != 0) {
            fprintf(stderr, "avx2_host: cannot handle SIGILL\n");
            _exit(2);
        }
        return;
    }
    if (sigaction(SIGSEGV, &action, &previous) != 0 || syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {
        fprintf(stderr, "avx2_host: CPUID faulting is not available on this kernel or CPU (no cpuid_fault)\n");
        _exit(2);
    }
}
