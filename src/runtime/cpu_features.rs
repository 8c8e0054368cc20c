//! What the CPU's instruction sets change in how graphs run: the features that select ONNX
//! Runtime's kernels (part of the CPU cache's key) and whether its int8 products saturate here.

/// `[(name, detected), ...]` through the detection macro `$on` (`is_x86_feature_detected`, ...).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! detect {
    ($on:ident: $($name:tt),*) => {
        [$(($name, $on!($name))),*]
    };
}

/// The architecture and the instruction sets the standard library detects (the CPUID
/// instruction's answer, which is what ONNX Runtime's kernel choice reads).
pub fn detected_features() -> String {
    #[cfg(target_arch = "x86_64")]
    let features = {
        use std::arch::is_x86_feature_detected as on;
        detect!(on: "avx", "avx2", "fma", "f16c", "avxvnni", "avx512f", "avx512bw", "avx512vnni", "avx512bf16")
    };
    #[cfg(target_arch = "aarch64")]
    let features = {
        use std::arch::is_aarch64_feature_detected as on;
        detect!(on: "dotprod", "i8mm", "bf16", "fp16", "sve", "sve2")
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let features: [(&str, bool); 0] = [];
    let found = features.iter().filter(|(_, on)| *on).map(|(name, _)| *name);
    std::iter::once(std::env::consts::ARCH)
        .chain(found)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether ONNX Runtime's u8 x s8 products (int8 bundles' `DynamicQuantizeMatMul`, the static
/// decoder's `QLinearConv`) can overflow on this CPU: x86-64 without VNNI (AVX2 hosts, AVX-512
/// without VNNI) sums pairs of products in 16 bits with saturation (`vpmaddubsw`), so a pair of
/// large activations against large weights of one sign comes out wrong. Where they can, sessions
/// set `session.x64quantprecision`, which turns the int8 weights into uint8 (u8 x u8 kernels, no
/// saturation; 153 against 201 GOP/s for one [1024, 3072] x [3072, 3072] product, one thread, AVX2).
/// Not set elsewhere: ONNX Runtime applies it to VNNI and AMX hosts too, where the u8 x u8 kernel
/// is ten times slower than AMX's (187 against 2088 GOP/s, same product).
pub fn int8_products_saturate() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !(std::arch::is_x86_feature_detected!("avxvnni")
            || std::arch::is_x86_feature_detected!("avx512vnni"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether a session of a graph converts its int8 weights to uint8 (`session.x64quantprecision`):
/// where products can saturate on this CPU, unless the graph's codes are 7-bit
/// (`weights_7bit`, `--reduce-range`: a pair of products is then at most 2 x 255 x 64 = 32640,
/// which 16 bits hold, and the faster u8 x s8 kernels are exact).
pub(crate) fn converts_int8_weights(weights_7bit: bool) -> bool {
    !weights_7bit && int8_products_saturate()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_start_with_the_architecture() {
        assert!(detected_features().starts_with(std::env::consts::ARCH));
    }

    #[test]
    fn seven_bit_weights_are_never_converted() {
        assert!(!converts_int8_weights(true));
        assert_eq!(converts_int8_weights(false), int8_products_saturate());
    }
}
