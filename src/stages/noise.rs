//! Initial noise, bit-identical to `torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))`
//! for float32, which is what diffusers' `randn_tensor` draws for the whole batch at once.
//!
//! Torch's CPU generator is MT19937 seeded with `init_genrand(seed as u32)`
//! (`ATen/core/MT19937RNGEngine.h`: only the low 32 bits of the 64-bit seed are used). `randn` then
//! runs one of two kernels (`ATen/native/cpu/DistributionTemplates.h`, `normal_kernel`):
//!
//! - 16 elements or more: `normal_fill`. Every element gets a uniform `u = (next_u32 & 0xFFFFFF) * 2^-24`;
//!   then each block of 16 is Box-Muller transformed in place (`out[j] = r cos t`, `out[j+8] = r sin t`
//!   with `r = sqrt(-2 ln(1 - u[j]))`, `t = 2 pi u[j+8]`, j < 8). When the count is not a multiple of
//!   16, the last 16 slots are redrawn from 16 fresh uniforms and transformed again.
//!   On x86 (AVX2 and AVX512 builds alike: `normal_stub` is not dispatched to AVX512) the transform is
//!   `NormalFill16<float>` with `log256_ps` / `sincos256_ps` from `ATen/native/cpu/avx_mathfun.h`
//!   (Cephes polynomials). This module ports those two functions to scalar f32, with the
//!   multiply-adds fused exactly where GCC fused them when it built torch (`-ffp-contract=fast`):
//!   checked bit-identical on 30 M values against torch 2.15.
//! - fewer than 16 elements: `at::normal_distribution<double>`, one pair of 53-bit uniforms per two
//!   outputs, `r = sqrt(-2 log1p(-u2))`, `t = 2 pi u1`, cos first, sin cached for the next element,
//!   each rounded to f32.
//!
//! Not reproduced: torch without AVX2 (ARM, or `ATEN_CPU_CAPABILITY=default`) uses libm's
//! `logf`/`cosf`/`sinf` in the 16-element kernel; its values differ from x86 torch's (and ours) by
//! up to about 2e-6 (38% of them not bit-identical, measured on 1 M values).
use ndarray::{ArrayD, IxDyn};

/// Elements per Box-Muller block of torch's `normal_fill`.
const BLOCK: usize = 16;

/// Draws a float32 standard normal tensor of `shape` (C order) exactly as torch's CPU generator does
/// after `manual_seed(seed)`. The whole tensor comes from one generator, as diffusers draws the
/// initial latents `[B, 128, h, w]` for a whole batch at once.
pub fn randn(seed: u64, shape: &[usize]) -> ArrayD<f32> {
    let count: usize = shape.iter().product();
    let mut rng = Mt19937::new(seed);
    let values = if count >= BLOCK {
        normal_fill(&mut rng, count)
    } else {
        normal_serial(&mut rng, count)
    };
    // [count] -> shape (standard layout, same element order as torch's contiguous tensor)
    ArrayD::from_shape_vec(IxDyn(shape), values)
        .unwrap_or_else(|_| unreachable!("the vector holds the product of the shape"))
}

/// Torch's `normal_fill` for float32 (count >= 16).
fn normal_fill(rng: &mut Mt19937, count: usize) -> Vec<f32> {
    let mut data: Vec<f32> = (0..count).map(|_| rng.uniform_f32()).collect();
    for block in data.chunks_exact_mut(BLOCK) {
        box_muller_16(block);
    }
    if !count.is_multiple_of(BLOCK) {
        // Torch recomputes the last 16 values from fresh uniforms (they overlap the last full block).
        let tail = &mut data[count - BLOCK..];
        for slot in tail.iter_mut() {
            *slot = rng.uniform_f32();
        }
        box_muller_16(tail);
    }
    data
}

/// Torch's `NormalFill16<float>` (AVX2 specialisation), in place on 16 uniforms in [0, 1).
/// With mean 0 and std 1 its final `fmadd(n, std, mean)` is the identity.
fn box_muller_16(data: &mut [f32]) {
    // `_mm256_set1_ps(2.0f * c10::pi<double>)`: the product is taken in double, then rounded.
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    for j in 0..BLOCK / 2 {
        let u1 = 1.0 - data[j];
        let u2 = data[j + BLOCK / 2];
        let radius = (-2.0 * log_cephes(u1)).sqrt();
        let (sin, cos) = sincos_cephes(two_pi * u2);
        data[j] = radius * cos;
        data[j + BLOCK / 2] = radius * sin;
    }
}

/// `log256_ps` of avx_mathfun.h for one lane (constants as written there: double literals rounded
/// to f32), for x in (0, 1] (the only inputs `normal_fill` gives:
/// `1 - u` with u in [0, 1 - 2^-24]); the original's clamp of denormals and NaN for x <= 0 never apply.
#[allow(clippy::excessive_precision)] // constants as written in avx_mathfun.h
fn log_cephes(x: f32) -> f32 {
    // avx_mathfun.h writes 0.707106781186547524, the same double.
    const SQRTHF: f32 = std::f64::consts::FRAC_1_SQRT_2 as f32;
    const P: [f32; 9] = [
        7.0376836292E-2_f64 as f32,
        -1.1514610310E-1_f64 as f32,
        1.1676998740E-1_f64 as f32,
        -1.2420140846E-1_f64 as f32,
        1.4249322787E-1_f64 as f32,
        -1.6668057665E-1_f64 as f32,
        2.0000714765E-1_f64 as f32,
        -2.4999993993E-1_f64 as f32,
        3.3333331174E-1_f64 as f32,
    ];
    const Q1: f32 = -2.12194440e-4_f64 as f32;
    const Q2: f32 = 0.693359375;
    let bits = x.to_bits();
    // Exponent (x > 0, so the logical shift sees no sign bit) and mantissa scaled to [0.5, 1).
    let exponent = (bits >> 23) as i32 - 0x7f;
    let mantissa = f32::from_bits((bits & !0x7f80_0000) | 0.5f32.to_bits());
    let mut e = exponent as f32 + 1.0;
    let below = mantissa < SQRTHF;
    let mut x = mantissa - 1.0;
    if below {
        e -= 1.0;
        x += mantissa;
    }
    let z = x * x;
    let mut y = P[0];
    for &p in &P[1..] {
        y = y.mul_add(x, p);
    }
    y *= x;
    y = y.mul_add(z, e * Q1);
    y = (-z).mul_add(0.5, y);
    x += y;
    e.mul_add(Q2, x)
}

/// `sincos256_ps` of avx_mathfun.h for one lane: returns (sin x, cos x).
#[allow(clippy::excessive_precision)] // constants as written in avx_mathfun.h
fn sincos_cephes(x: f32) -> (f32, f32) {
    const FOPI: f32 = 1.27323954473516_f64 as f32; // 4 / pi
    const DP: [f32; 3] = [
        -0.78515625,
        -2.4187564849853515625e-4,
        -3.77489497744594108e-8_f64 as f32,
    ];
    const SINCOF: [f32; 3] = [
        -1.9515295891E-4_f64 as f32,
        8.3321608736E-3_f64 as f32,
        -1.6666654611E-1_f64 as f32,
    ];
    const COSCOF: [f32; 3] = [
        2.443315711809948E-005_f64 as f32,
        -1.388731625493765E-003_f64 as f32,
        4.166664568298827E-002_f64 as f32,
    ];
    const SIGN: u32 = 0x8000_0000;

    let sign_sin = x.to_bits() & SIGN;
    let mut x = x.abs();
    // j = (trunc(x * 4/pi) + 1) & !1: the octant, rounded to even.
    let j = ((x * FOPI) as i32 + 1) & !1;
    let y = j as f32;
    let sign_sin = sign_sin ^ (((j & 4) as u32) << 29);
    let sign_cos = ((!(j - 2) & 4) as u32) << 29;
    let cos_poly_is_cos = j & 2 == 0;
    // Extended precision modular arithmetic: x = ((x - y DP1) - y DP2) - y DP3.
    for dp in DP {
        x = y.mul_add(dp, x);
    }
    let z = x * x;
    let mut yc = COSCOF[0];
    yc = yc.mul_add(z, COSCOF[1]);
    yc = yc.mul_add(z, COSCOF[2]);
    yc = (yc * z).mul_add(z, -(z * 0.5));
    yc += 1.0;
    let mut ys = SINCOF[0];
    ys = ys.mul_add(z, SINCOF[1]);
    ys = ys.mul_add(z, SINCOF[2]);
    ys = (ys * z).mul_add(x, x);
    let (sin, cos) = if cos_poly_is_cos { (ys, yc) } else { (yc, ys) };
    (
        f32::from_bits(sin.to_bits() ^ sign_sin),
        f32::from_bits(cos.to_bits() ^ sign_cos),
    )
}

/// Torch's serial path for fewer than 16 elements: `at::normal_distribution<double>` per element,
/// each Box-Muller pair giving cos now and caching sin for the next element.
fn normal_serial(rng: &mut Mt19937, count: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(count);
    let mut cached: Option<f64> = None;
    for _ in 0..count {
        let value = match cached.take() {
            Some(value) => value,
            None => {
                let u1 = rng.uniform_f64();
                let u2 = rng.uniform_f64();
                let r = (-2.0 * (-u2).ln_1p()).sqrt();
                let theta = 2.0 * std::f64::consts::PI * u1;
                cached = Some(r * theta.sin());
                r * theta.cos()
            }
        };
        out.push(value as f32);
    }
    out
}

/// MT19937 as torch's `at::mt19937` (the same stream as numpy's legacy `RandomState(seed)`).
struct Mt19937 {
    state: [u32; Self::N],
    next: usize,
}

impl Mt19937 {
    const N: usize = 624;
    const M: usize = 397;
    const MATRIX_A: u32 = 0x9908_b0df;
    const UPPER: u32 = 0x8000_0000;
    const LOWER: u32 = 0x7fff_ffff;

    /// `init_with_uint32`: torch keeps only the low 32 bits of the seed.
    fn new(seed: u64) -> Self {
        let mut state = [0u32; Self::N];
        state[0] = seed as u32;
        for j in 1..Self::N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(j as u32);
        }
        Self {
            state,
            next: Self::N,
        }
    }

    fn twist(&mut self) {
        for i in 0..Self::N {
            let y = (self.state[i] & Self::UPPER) | (self.state[(i + 1) % Self::N] & Self::LOWER);
            let mut v = self.state[(i + Self::M) % Self::N] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= Self::MATRIX_A;
            }
            self.state[i] = v;
        }
        self.next = 0;
    }

    fn next_u32(&mut self) -> u32 {
        if self.next >= Self::N {
            self.twist();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `uniform_real_distribution<float>(0, 1)`: the low 24 bits of one draw, times 2^-24.
    fn uniform_f32(&mut self) -> f32 {
        (self.next_u32() & 0x00ff_ffff) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// `uniform_real_distribution<double>(0, 1)`: `random64()` is (first << 32 | second); its low 53
    /// bits times 2^-53.
    fn uniform_f64(&mut self) -> f64 {
        let hi = u64::from(self.next_u32());
        let lo = u64::from(self.next_u32());
        (((hi << 32) | lo) & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/noise.safetensors"
    );

    #[test]
    fn mt19937_matches_the_cpp_standard_check_value() {
        // [rand.predef]: the 10000th output of a default-constructed std::mt19937 (seed 5489).
        let mut rng = Mt19937::new(5489);
        let value = (0..10_000).map(|_| rng.next_u32()).last();
        assert_eq!(value, Some(4_123_659_995));
    }

    /// Compares against torch.randn (tests/fixtures/make_noise_values.py): every value must be
    /// bit-identical (tolerance 0), for the 16-element kernel, the redrawn tail, the serial path for
    /// fewer than 16 elements, and seeds above 2^32.
    #[test]
    fn randn_is_bit_identical_to_torch() {
        let bytes = std::fs::read(FIXTURE).unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = tensors.names();
        names.sort();
        assert_eq!(names.len(), 11, "cases in {FIXTURE}");
        for name in names {
            let view = tensors.tensor(name).unwrap();
            let seed: u64 = name
                .strip_prefix("seed_")
                .and_then(|rest| rest.split('/').next())
                .unwrap()
                .parse()
                .unwrap();
            let expected: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let got = randn(seed, view.shape());
            assert_eq!(got.shape(), view.shape(), "{name}: shape");
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    g.to_bits() == e.to_bits(),
                    "{name} shape {:?} element {i}: expected {e:e} ({:#010x}), got {g:e} ({:#010x})",
                    view.shape(),
                    e.to_bits(),
                    g.to_bits()
                );
            }
        }
    }

    #[test]
    fn seed_uses_only_the_low_32_bits() {
        assert_eq!(
            randn(7, &[1, 128, 1, 1]),
            randn((1 << 32) + 7, &[1, 128, 1, 1])
        );
    }

    #[test]
    fn empty_shape_gives_an_empty_tensor() {
        assert_eq!(randn(0, &[0, 128, 2, 2]).len(), 0);
    }
}
