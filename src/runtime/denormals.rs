//! Denormal floats flushed to zero while ONNX Runtime computes (x86-64).
//!
//! Where attention is sharp, the softmax's exponentials underflow into denormal floats (below
//! 1.2e-38), and x86 cores compute with those many times slower than with normal ones: one
//! 1536-token attention (24 x 128 heads, ONNX Runtime's MultiHeadAttention, 2 threads) took 328 ms
//! with sharp scores against 106 ms with flat ones, and 106 ms with sharp ones flushed. Flushing
//! changes results only below 1.2e-38.
//!
//! ONNX Runtime flushes on its pool threads when a session has `session.set_denormal_as_zero`
//! (every session klein builds does), but the thread that calls `Run` computes its share of the
//! work too, and ONNX Runtime sets the flags on a calling thread only once per process: for good,
//! on the thread that creates the first session. [`flushed`] sets flush-to-zero and
//! denormals-are-zero on the current thread while it runs a closure and then puts the thread's own
//! flags back, so runs are flushed on whatever thread calls them, and an embedding application's own
//! arithmetic keeps its flags (session creation is wrapped too, undoing ONNX Runtime's change).
//! On other architectures it does nothing (ONNX Runtime flushes on x86 only).

/// Runs `f` with denormals flushed on this thread, then puts the thread's own flags back.
pub(super) fn flushed<T>(f: impl FnOnce() -> T) -> T {
    let _flushed = Flushed::new();
    f()
}

/// The current thread's denormal flags, set to flush until dropped.
struct Flushed {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl Flushed {
    /// Sets flush-to-zero and denormals-are-zero on this thread.
    fn new() -> Flushed {
        #[cfg(target_arch = "x86_64")]
        {
            let saved = mxcsr::read();
            mxcsr::write(saved | mxcsr::FLUSH);
            Flushed { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Flushed {}
    }
}

impl Drop for Flushed {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        mxcsr::write(self.saved);
    }
}

/// The SSE control and status register, which holds the flags.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod mxcsr {
    use std::arch::asm;

    /// Flush-to-zero (bit 15: denormal results become 0) and denormals-are-zero (bit 6: denormal
    /// inputs read as 0).
    pub(super) const FLUSH: u32 = 1 << 15 | 1 << 6;

    pub(super) fn read() -> u32 {
        let mut value = 0u32;
        // SAFETY: `stmxcsr` stores the 32-bit register into `value`, a live local of that size.
        unsafe {
            asm!("stmxcsr [{}]", in(reg) &mut value, options(nostack, preserves_flags));
        }
        value
    }

    pub(super) fn write(value: u32) {
        // SAFETY: `ldmxcsr` loads the register from `value`, a live local; callers pass a value
        // read from the register with at most the two flush bits added, so no reserved bit is set
        // (which would fault) and exceptions stay masked as they were.
        unsafe {
            asm!("ldmxcsr [{}]", in(reg) &value, options(nostack, preserves_flags, readonly));
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::hint::black_box;

    #[test]
    fn denormals_flush_inside_and_the_threads_flags_come_back_after() {
        // The control bits only: the low six are sticky status flags that arithmetic sets.
        let control = || mxcsr::read() & !0x3f;
        let before = control();
        let tiny = black_box(f32::MIN_POSITIVE); // 1.18e-38, the smallest normal float
        assert!(
            black_box(tiny * 0.5) > 0.0,
            "denormal results are kept by default"
        );
        flushed(|| {
            assert_eq!(mxcsr::read() & mxcsr::FLUSH, mxcsr::FLUSH);
            assert_eq!(
                black_box(tiny * 0.5),
                0.0,
                "a denormal result is flushed to zero"
            );
            let denormal = black_box(f32::from_bits(1)); // the smallest denormal, as an input
            assert_eq!(
                black_box(denormal * 2.0),
                0.0,
                "a denormal input reads as zero"
            );
        });
        assert_eq!(control(), before);
        assert!(black_box(tiny * 0.5) > 0.0);
    }
}
