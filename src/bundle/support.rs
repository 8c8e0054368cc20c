//! Which bundles each execution provider can run, checked from the manifest before any weight is
//! loaded.
//!
//! The table follows the kernels ONNX Runtime 1.31 registers for each provider:
//! - **CPU**: float32 and float16 graphs (float16 MatMul/Conv/Gemm kernels exist, or ORT inserts
//!   casts around the few without); `MatMulNBits` with 4 or 8 bits. No bfloat16 kernels for
//!   MatMul, Conv or the norms.
//! - **CUDA**: float32, float16 and bfloat16; `MatMulNBits` with 4 or 8 bits.
//! - **CoreML**: float32 and float16 (MLProgram computes in float16 on the GPU and Neural
//!   Engine). No bfloat16, and no `MatMulNBits`: ORT would run every quantized MatMul on the CPU,
//!   one partition per layer, copying activations back and forth (slower than the CPU alone).
//!
//! [`Device::Auto`] falls back to the CPU, so a bundle passes for `auto` when the CPU runs it.
//! CUDA and CoreML rows are what ONNX Runtime documents and registers; they have not been run on
//! such hardware here (see the README).
use super::manifest::{GraphsSpec, Precision, QuantizationSpec};
use crate::error::{KleinError, Result};
use crate::runtime::Device;

/// Why `device` cannot run one graph of this precision and quantization (`None`: it can).
pub fn unsupported(
    device: Device,
    precision: Precision,
    quantization: Option<&QuantizationSpec>,
) -> Option<String> {
    let device = if device == Device::Auto {
        Device::Cpu
    } else {
        device
    };
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
        _ if q.method != "MatMulNBits" => Some(format!(
            "klein runs weight-only MatMulNBits quantization only, this graph uses `{}`",
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
    fn bf16_runs_on_cuda_only() {
        assert_eq!(unsupported(Device::Cuda(1), Precision::Bf16, None), None);
        for device in [Device::Cpu, Device::CoreMl, Device::Auto] {
            let reason = unsupported(device, Precision::Bf16, None).expect("refused");
            assert!(reason.contains("--precision fp16"), "{reason}");
        }
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
            let reason =
                unsupported(device, Precision::Fp32, Some(&q(8, "QDQ"))).expect("QDQ refused");
            assert!(reason.contains("`QDQ`"), "{reason}");
        }
        let reason = unsupported(Device::CoreMl, Precision::Fp16, Some(&q(4, "MatMulNBits")))
            .expect("CoreML refuses quantized graphs");
        assert!(reason.contains("--device cpu"), "{reason}");
    }
}
