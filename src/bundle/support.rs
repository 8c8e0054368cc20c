//! Which bundles each execution provider can run, checked from the manifest before any weight is
//! loaded.
//!
//! The table follows the kernels ONNX Runtime 1.31 registers for each provider:
//! - **CPU**: float32 and float16 graphs (float16 MatMul/Conv/Gemm kernels exist, or ORT inserts
//!   casts around the few without); `MatMulNBits` with 4 or 8 bits; `DynamicQuantizeMatMul` (int8
//!   weights, activations quantized at run time); `QDQ` (the VAE decoder's int8 convolutions, fused
//!   into `QLinearConv`). No bfloat16 kernels for MatMul, Conv or the norms.
//! - **CUDA**: float32, float16 and bfloat16; `MatMulNBits` with 4 or 8 bits. No
//!   `DynamicQuantizeMatMul` (a CPU-only contrib kernel), and no QDQ (without TensorRT it would
//!   dequantize and convolve in float: the int8 error for none of the speed).
//! - **CoreML**: float32 and float16 (MLProgram computes in float16 on the GPU and Neural
//!   Engine). No bfloat16, and no `MatMulNBits`: ORT would run every quantized MatMul on the CPU,
//!   one partition per layer, copying activations back and forth (slower than the CPU alone).
//!
//! A bundle passes for [`Device::Auto`] when one of the devices auto tries in this build
//! ([`Device::auto_candidates`]) runs it; auto then skips, per graph, the devices that cannot
//! ([`auto_skip`]), and says why.
//! CUDA and CoreML rows are what ONNX Runtime documents and registers; they have not been run on
//! such hardware (see docs/pipelines.md).
use super::manifest::{GraphsSpec, Precision, QuantizationSpec};
use crate::error::{KleinError, Result};
use crate::runtime::Device;

/// Weight-only blockwise quantization (`--method nbits`).
const NBITS: &str = "MatMulNBits";
/// int8 weights per channel and activations quantized at run time (`--method dynamic`).
pub(crate) const DYNAMIC: &str = "DynamicQuantizeMatMul";
/// The VAE decoder's convolutions in int8, activation ranges calibrated (`--method static`).
const QDQ: &str = "QDQ";

/// Why `device` cannot run one graph of this precision and quantization (`None`: it can).
pub fn unsupported(
    device: Device,
    precision: Precision,
    quantization: Option<&QuantizationSpec>,
) -> Option<String> {
    if device == Device::Auto {
        // Auto can run a graph when one of the devices it tries can.
        let mut reasons = Vec::new();
        for candidate in Device::auto_candidates() {
            match unsupported(candidate, precision, quantization) {
                None => return None,
                Some(reason) => reasons.push(format!("{candidate}: {reason}")),
            }
        }
        return Some(format!(
            "no device auto tries in this build can run it ({})",
            reasons.join("; ")
        ));
    }
    let precision_ok = match device {
        Device::Cuda(_) => true,
        Device::Cpu | Device::CoreMl | Device::Auto => precision != Precision::Bf16,
    };
    if !precision_ok {
        return Some(format!(
            "{} has no bfloat16 kernels for this model's operators; export the bundle with \
             `--precision fp16` or `fp32`",
            device.ep_name()
        ));
    }
    let q = quantization?;
    match device {
        Device::CoreMl => Some(format!(
            "CoreMLExecutionProvider cannot run {}-bit {} weights (every quantized MatMul would run on the \
             CPU, one partition per layer); use an fp16 or fp32 bundle on CoreML, or this bundle with \
             --device cpu",
            q.bits, q.method
        )),
        Device::Cpu if (q.method == DYNAMIC || q.method == QDQ) && q.bits == 8 => None,
        _ if q.method == DYNAMIC => Some(format!(
            "{} cannot run {}-bit {DYNAMIC} (ONNX Runtime has it for 8 bits, on the CPU only); \
             run this bundle with --device cpu, or quantize with `--method nbits`",
            device.ep_name(),
            q.bits
        )),
        _ if q.method == QDQ => Some(format!(
            "{} runs {}-bit QDQ convolutions (`--method static`) as float, no faster than fp32 and \
             with the int8 error; klein runs them on the CPU only: run this bundle with --device cpu, \
             or use a bundle with a float VAE decoder",
            device.ep_name(),
            q.bits
        )),
        _ if q.method != NBITS => Some(format!(
            "klein runs {NBITS}, {DYNAMIC} and {QDQ} quantization only, this graph uses `{}`",
            q.method
        )),
        _ if q.bits != 4 && q.bits != 8 => Some(format!(
            "{} runs MatMulNBits with 4 or 8 bits, this graph has {}",
            device.ep_name(),
            q.bits
        )),
        _ => None,
    }
}

/// Whether a graph's weights are int8 codes run by u8 x s8 kernels on the CPU (`--method dynamic`
/// or `static`) in the full 8 bits, without `--reduce-range`: the weights that CPUs without VNNI
/// convert to uint8 ([`crate::runtime::converts_int8_weights`]).
pub(crate) fn has_8bit_int8_codes(quantization: Option<&QuantizationSpec>) -> bool {
    quantization
        .is_some_and(|q| (q.method == DYNAMIC || q.method == QDQ) && q.bits == 8 && !q.reduce_range)
}

/// What the CPU at hand does with a bundle's int8 weights (`klein info`): which kernels ONNX Runtime
/// runs them on here and whether that is slower or less exact than on a CPU with VNNI. None for a
/// bundle without int8 codes run by u8 x s8 kernels (float graphs, `MatMulNBits`).
pub fn cpu_int8_kernels(graphs: &GraphsSpec) -> Option<String> {
    let mut eight = Vec::new();
    let mut seven = Vec::new();
    for (name, spec) in graphs.iter() {
        let q = spec.quantization.as_ref();
        if has_8bit_int8_codes(q) {
            eight.push(name.as_str());
        } else if q.is_some_and(|q| q.reduce_range) {
            seven.push(name.as_str());
        }
    }
    if eight.is_empty() && seven.is_empty() {
        return None;
    }
    let saturate = crate::runtime::int8_products_saturate();
    let mut parts = Vec::new();
    if !eight.is_empty() {
        parts.push(if saturate {
            format!(
                "{} (8-bit codes): this CPU has no VNNI, so ONNX Runtime converts these weights to \
                 uint8 at load and runs u8 x u8 kernels: as exact as on a VNNI CPU, but slower; \
                 `klein-export quantize --quantize int8 --method dynamic --reduce-range` writes \
                 7-bit codes that keep the fast kernels here, with a larger error",
                eight.join(", ")
            )
        } else {
            format!(
                "{} (8-bit codes): u8 x s8 kernels, exact (this CPU has VNNI, or is not x86-64)",
                eight.join(", ")
            )
        });
    }
    if !seven.is_empty() {
        parts.push(format!(
            "{} (7-bit codes, --reduce-range): u8 x s8 kernels, exact on every CPU{}",
            seven.join(", "),
            if saturate {
                " (the fast kernels on this CPU without VNNI)"
            } else {
                "; on this CPU 8-bit codes would be as fast and more exact"
            }
        ));
    }
    Some(parts.join("; "))
}

/// The devices auto must not try for a graph of this precision and quantization, with why.
pub fn auto_skip(
    precision: Precision,
    quantization: Option<&QuantizationSpec>,
) -> Vec<(Device, String)> {
    Device::auto_candidates()
        .into_iter()
        .filter_map(|d| unsupported(d, precision, quantization).map(|why| (d, why)))
        .collect()
}

/// Checks every graph of a bundle against `device`, naming the first graph it cannot run.
pub fn check_bundle(device: Device, graphs: &GraphsSpec, bundle: &std::path::Path) -> Result<()> {
    for (name, spec) in graphs.iter() {
        if let Some(reason) = unsupported(device, spec.precision, spec.quantization.as_ref()) {
            let quantized = spec
                .quantization
                .as_ref()
                .map(|q| format!(" with {}-bit weights", q.bits))
                .unwrap_or_default();
            return Err(KleinError::Device {
                device: device.to_string(),
                message: format!(
                    "bundle {} has a {} {name} graph{quantized}: {reason}",
                    bundle.display(),
                    spec.precision
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(bits: u32, method: &str) -> QuantizationSpec {
        serde_json::from_value(serde_json::json!({"method": method, "bits": bits}))
            .expect("a valid quantization spec")
    }

    #[test]
    fn every_provider_runs_fp32_and_fp16() {
        for device in [Device::Cpu, Device::Cuda(0), Device::CoreMl, Device::Auto] {
            for precision in [Precision::Fp32, Precision::Fp16] {
                assert_eq!(
                    unsupported(device, precision, None),
                    None,
                    "{device} {precision}"
                );
            }
        }
    }

    #[test]
    fn dynamic_int8_runs_on_the_cpu_only() {
        let dynamic = q(8, DYNAMIC);
        assert_eq!(
            unsupported(Device::Cpu, Precision::Fp32, Some(&dynamic)),
            None
        );
        let cuda = unsupported(Device::Cuda(0), Precision::Fp32, Some(&dynamic)).expect("refused");
        assert!(cuda.contains("--device cpu"), "{cuda}");
        assert!(unsupported(Device::CoreMl, Precision::Fp32, Some(&dynamic)).is_some());
        assert!(unsupported(Device::Cpu, Precision::Fp32, Some(&q(4, DYNAMIC))).is_some());
        // Auto runs it on the CPU, which every build has.
        assert_eq!(
            unsupported(Device::Auto, Precision::Fp32, Some(&dynamic)),
            None
        );
        let other =
            unsupported(Device::Cpu, Precision::Fp32, Some(&q(8, "QOperator"))).expect("refused");
        assert!(other.contains("`QOperator`"), "{other}");
    }

    #[test]
    fn static_int8_convolutions_run_on_the_cpu_only() {
        let qdq = q(8, QDQ);
        for device in [Device::Cpu, Device::Auto] {
            assert_eq!(unsupported(device, Precision::Fp32, Some(&qdq)), None);
        }
        for device in [Device::Cuda(0), Device::CoreMl] {
            let reason = unsupported(device, Precision::Fp32, Some(&qdq)).expect("refused");
            assert!(reason.contains("--device cpu"), "{reason}");
        }
        assert!(unsupported(Device::Cpu, Precision::Fp32, Some(&q(4, QDQ))).is_some());
    }

    #[test]
    fn bf16_runs_on_cuda_only() {
        assert_eq!(unsupported(Device::Cuda(1), Precision::Bf16, None), None);
        for device in [Device::Cpu, Device::CoreMl] {
            let reason = unsupported(device, Precision::Bf16, None).expect("refused");
            assert!(reason.contains("--precision fp16"), "{reason}");
        }
    }

    /// Auto runs a bf16 bundle when this build can try CUDA (skipping the CPU for it), and
    /// refuses it, naming every device it tried, when it cannot.
    #[test]
    fn auto_checks_the_devices_it_tries() {
        let skip = auto_skip(Precision::Bf16, None);
        assert!(skip.iter().any(|(d, _)| *d == Device::Cpu), "{skip:?}");
        let refused = unsupported(Device::Auto, Precision::Bf16, None);
        assert_eq!(refused.is_none(), cfg!(feature = "cuda"), "{refused:?}");
        if let Some(reason) = refused {
            assert!(
                reason.contains("no device auto tries") && reason.contains("cpu: "),
                "{reason}"
            );
        }
        assert!(auto_skip(Precision::Fp32, None).is_empty());
    }

    #[test]
    fn matmulnbits_runs_on_cpu_and_cuda_with_4_or_8_bits() {
        for device in [Device::Cpu, Device::Cuda(0), Device::Auto] {
            for bits in [4, 8] {
                assert_eq!(
                    unsupported(device, Precision::Fp32, Some(&q(bits, "MatMulNBits"))),
                    None
                );
            }
            let reason = unsupported(device, Precision::Fp32, Some(&q(3, "MatMulNBits")))
                .expect("3 bits refused");
            assert!(reason.contains("4 or 8 bits"), "{reason}");
            let reason = unsupported(device, Precision::Fp32, Some(&q(8, "QOperator")))
                .expect("QOperator refused");
            assert!(reason.contains("`QOperator`"), "{reason}");
        }
        let reason = unsupported(Device::CoreMl, Precision::Fp16, Some(&q(4, "MatMulNBits")))
            .expect("CoreML refuses quantized graphs");
        assert!(reason.contains("--device cpu"), "{reason}");
    }
}
