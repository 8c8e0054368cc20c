//! Sigma schedule: diffusers' `compute_empirical_mu` (pipelines/flux2/pipeline_flux2_klein.py) and
//! `FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace(1, 1/N, N), mu=mu)`
//! (schedulers/scheduling_flow_match_euler_discrete.py), reproduced bit for bit, float32 where numpy
//! and torch compute in float32 and float64 where Python does.
use serde::{Deserialize, Serialize};

use crate::error::{KleinError, Result};

/// Constants of `compute_empirical_mu`: two linear fits of mu against the image token count, one
/// for 10 and one for 200 steps, interpolated in the step count below `seq_len_threshold` tokens.
/// Mirrors the manifest's `scheduler.empirical_mu` section.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EmpiricalMu {
    /// Slope of the 10-step line.
    pub a1: f64,
    /// Intercept of the 10-step line.
    pub b1: f64,
    /// Slope of the 200-step line.
    pub a2: f64,
    /// Intercept of the 200-step line.
    pub b2: f64,
    /// Above this many image tokens, the 200-step line is used alone.
    pub seq_len_threshold: usize,
}

impl EmpiricalMu {
    /// The values of diffusers 0.42.1 `compute_empirical_mu` (pipeline_flux2_klein.py, copied from
    /// pipeline_flux2.py).
    pub const FLUX2: EmpiricalMu = EmpiricalMu {
        a1: 8.73809524e-05,
        b1: 1.89833333,
        a2: 0.00016927,
        b2: 0.45666666,
        seq_len_threshold: 4300,
    };
}

/// Step counts the two fits of [`EmpiricalMu`] were made at (`m_10`, `m_200` in diffusers).
const FIT_STEPS_LOW: f64 = 10.0;
const FIT_STEPS_HIGH: f64 = 200.0;

/// diffusers' `compute_empirical_mu(image_seq_len, num_steps)`, in f64 as Python computes it.
/// `image_seq_len` is the number of output latent tokens (h*w), reference tokens not counted.
pub fn compute_empirical_mu(
    constants: &EmpiricalMu,
    image_seq_len: usize,
    num_steps: usize,
) -> f64 {
    let EmpiricalMu {
        a1,
        b1,
        a2,
        b2,
        seq_len_threshold,
    } = *constants;
    let seq_len = image_seq_len as f64;
    if image_seq_len > seq_len_threshold {
        return a2 * seq_len + b2;
    }
    let m_high = a2 * seq_len + b2;
    let m_low = a1 * seq_len + b1;
    let a = (m_high - m_low) / (FIT_STEPS_HIGH - FIT_STEPS_LOW);
    let b = m_high - FIT_STEPS_HIGH * a;
    a * num_steps as f64 + b
}

/// `time_shift_type` of the scheduler config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeShiftType {
    /// `e^mu / (e^mu + (1/sigma - 1))`
    Exponential,
    /// `mu / (mu + (1/sigma - 1))`
    Linear,
}

/// The `FlowMatchEulerDiscreteScheduler` settings that shape the sigmas (names as in its
/// `scheduler_config.json`). Deserialises from the manifest's `scheduler` section (other keys there
/// are ignored, so it can be `#[serde(flatten)]`ed into a struct that also reads them). The options
/// this runtime does not implement default to off and make [`ShiftConfig::check`] fail when set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShiftConfig {
    /// Training timesteps (1000): `timesteps = sigmas * num_train_timesteps`.
    pub num_train_timesteps: u32,
    /// Static shift, used only when `use_dynamic_shifting` is false.
    pub shift: f64,
    /// Whether mu (from [`compute_empirical_mu`]) shifts the sigmas (true for klein).
    pub use_dynamic_shifting: bool,
    /// How mu shifts the sigmas.
    pub time_shift_type: TimeShiftType,
    // Unsupported options: absent or off in a bundle this runtime accepts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shift_terminal: Option<f64>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub use_karras_sigmas: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub use_exponential_sigmas: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub use_beta_sigmas: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub invert_sigmas: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub stochastic_sampling: bool,
}

fn is_false(value: &bool) -> bool {
    !value
}

impl ShiftConfig {
    /// The scheduler of the FLUX.2-klein checkpoints: exponential dynamic shifting.
    pub const FLUX2_KLEIN: ShiftConfig = ShiftConfig {
        num_train_timesteps: 1000,
        shift: 3.0,
        use_dynamic_shifting: true,
        time_shift_type: TimeShiftType::Exponential,
        shift_terminal: None,
        use_karras_sigmas: false,
        use_exponential_sigmas: false,
        use_beta_sigmas: false,
        invert_sigmas: false,
        stochastic_sampling: false,
    };

    /// Refuses the scheduler options this runtime does not implement, rather than ignoring them.
    pub fn check(&self) -> Result<()> {
        let unsupported = [
            // diffusers tests `if self.config.shift_terminal:`, so 0.0 means off.
            (
                "shift_terminal",
                self.shift_terminal.is_some_and(|t| t != 0.0),
            ),
            ("use_karras_sigmas", self.use_karras_sigmas),
            ("use_exponential_sigmas", self.use_exponential_sigmas),
            ("use_beta_sigmas", self.use_beta_sigmas),
            ("invert_sigmas", self.invert_sigmas),
            ("stochastic_sampling", self.stochastic_sampling),
        ];
        if let Some(&(setting, _)) = unsupported.iter().find(|(_, on)| *on) {
            return Err(KleinError::Scheduler {
                setting,
                reason: "this runtime implements only the plain Euler flow-matching schedule \
                         (dynamic exponential/linear or static shift); re-export the bundle with \
                         the option turned off"
                    .to_string(),
            });
        }
        if self.num_train_timesteps == 0 {
            return Err(KleinError::Scheduler {
                setting: "num_train_timesteps",
                reason: "must be at least 1".to_string(),
            });
        }
        Ok(())
    }
}

/// The schedule of one generation, as the scheduler holds it after `set_timesteps`.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// `scheduler.sigmas`: N shifted sigmas then 0 (N+1 values). The Euler step uses these.
    pub sigmas: Vec<f32>,
    /// `scheduler.timesteps`: `sigma * num_train_timesteps` in f32 (N values).
    pub timesteps: Vec<f32>,
    num_train_timesteps: f32,
}

impl Schedule {
    pub fn num_steps(&self) -> usize {
        self.timesteps.len()
    }

    /// The timestep the pipeline feeds the transformer at step `i`: `timestep / 1000` in f32, which
    /// is not always bit-equal to `sigmas[i]`.
    pub fn transformer_timestep(&self, step: usize) -> f32 {
        self.timesteps[step] / self.num_train_timesteps
    }

    /// The schedule from step `first` on, as `get_timesteps` leaves the scheduler for a strength
    /// below 1 (`timesteps[first:]` and `set_begin_index(first)`: the steps index the sigmas from
    /// there). `first` must be below [`Schedule::num_steps`].
    pub fn starting_at(&self, first: usize) -> Schedule {
        Schedule {
            sigmas: self.sigmas[first..].to_vec(),
            timesteps: self.timesteps[first..].to_vec(),
            num_train_timesteps: self.num_train_timesteps,
        }
    }

    /// `scheduler.sigmas[i]`: the noise level before step `i` (`i = num_steps` is the final 0).
    pub fn sigma(&self, i: usize) -> f32 {
        self.sigmas[i]
    }

    /// `dt = sigma_next - sigma` of `FlowMatchEulerDiscreteScheduler.step` at step `i` (f32,
    /// negative); the step is `x + dt * v`.
    pub fn dt(&self, step: usize) -> f32 {
        self.sigmas[step + 1] - self.sigmas[step]
    }
}

/// `set_timesteps(sigmas=np.linspace(1.0, 1/N, N), mu=mu)` as `Flux2KleinPipeline` calls it.
/// `mu` is used only with dynamic shifting (see [`compute_empirical_mu`]).
pub fn schedule(num_steps: usize, mu: f64, config: &ShiftConfig) -> Result<Schedule> {
    config.check()?;
    if num_steps == 0 {
        return Err(KleinError::request(
            "the number of steps must be at least 1",
        ));
    }
    let mut sigmas: Vec<f32> = linspace(1.0, 1.0 / num_steps as f64, num_steps)
        .into_iter()
        .map(|s| shift_sigma(s as f32, mu, config))
        .collect();
    // Out-of-range scheduler numbers (exp(mu) overflowing, 0/0) would denoise with NaN: the
    // reference pipeline fails there too (Python's math.exp raises OverflowError).
    if let Some(bad) = sigmas.iter().find(|s| !s.is_finite()) {
        let (setting, source) = if config.use_dynamic_shifting {
            (
                "empirical_mu",
                format!("mu {mu} (from scheduler.empirical_mu)"),
            )
        } else {
            ("shift", format!("shift {}", config.shift))
        };
        return Err(KleinError::Scheduler {
            setting,
            reason: format!(
                "{source} gives sigma {bad} for {num_steps} steps; the bundle's scheduler numbers \
                 are out of range: re-export it"
            ),
        });
    }
    let num_train_timesteps = config.num_train_timesteps as f32;
    let timesteps = sigmas.iter().map(|s| s * num_train_timesteps).collect();
    sigmas.push(0.0);
    Ok(Schedule {
        sigmas,
        timesteps,
        num_train_timesteps,
    })
}

/// Step 2 of `set_timesteps` on one float32 sigma. numpy (NEP 50) casts the Python-float operands to
/// float32 and computes in float32; `(1/t - 1) ** 1.0` is exact.
fn shift_sigma(sigma: f32, mu: f64, config: &ShiftConfig) -> f32 {
    if config.use_dynamic_shifting {
        let numerator = match config.time_shift_type {
            // math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
            TimeShiftType::Exponential => mu.exp() as f32,
            // mu / (mu + (1 / t - 1) ** 1.0)
            TimeShiftType::Linear => mu as f32,
        };
        numerator / (numerator + (1.0 / sigma - 1.0))
    } else {
        // shift * sigmas / (1 + (shift - 1) * sigmas)
        let shift = config.shift as f32;
        let shift_minus_one = (config.shift - 1.0) as f32;
        shift * sigma / (1.0 + shift_minus_one * sigma)
    }
}

/// `np.linspace(start, stop, num)` in f64: `i * step + start`, the last value set to `stop`.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num == 1 {
        return vec![start];
    }
    let step = (stop - start) / (num - 1) as f64;
    let mut values: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    values[num - 1] = stop;
    values
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use safetensors::{Dtype, SafeTensors};

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/schedule.safetensors"
    );

    fn read_f32(tensors: &SafeTensors, name: &str) -> Vec<f32> {
        let view = tensors.tensor(name).unwrap();
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        view.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    fn read_f64(tensors: &SafeTensors, name: &str) -> f64 {
        let view = tensors.tensor(name).unwrap();
        assert_eq!(view.dtype(), Dtype::F64, "{name}");
        f64::from_le_bytes(view.data()[..8].try_into().unwrap())
    }

    fn assert_bits_eq(what: &str, expected: &[f32], got: &[f32]) {
        let same = expected.len() == got.len()
            && expected
                .iter()
                .zip(got)
                .all(|(e, g)| e.to_bits() == g.to_bits());
        assert!(same, "{what}:\n  expected {expected:?}\n  got      {got:?}");
    }

    fn config(name: &str) -> ShiftConfig {
        match name {
            "exponential" => ShiftConfig::FLUX2_KLEIN,
            "linear" => ShiftConfig {
                time_shift_type: TimeShiftType::Linear,
                ..ShiftConfig::FLUX2_KLEIN
            },
            "static" => ShiftConfig {
                use_dynamic_shifting: false,
                ..ShiftConfig::FLUX2_KLEIN
            },
            other => panic!("unknown config {other} in {FIXTURE}"),
        }
    }

    /// Against diffusers' scheduler (tests/fixtures/make_schedule_values.py), tolerance 0: mu (f64),
    /// sigmas, timesteps, the transformer's timestep / 1000 and the Euler dt (f32), bit for bit,
    /// for exponential, linear and static shifting, N in {1,2,4,28,50}, L in {16,...,5000}.
    #[test]
    fn schedule_is_bit_identical_to_diffusers() {
        let bytes = std::fs::read(FIXTURE).unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let mut cases: Vec<&str> = tensors
            .names()
            .into_iter()
            .filter_map(|name| name.strip_suffix("/mu"))
            .collect();
        cases.sort();
        assert_eq!(cases.len(), 90, "cases in {FIXTURE}");
        for case in cases {
            let (config_name, params) = case.split_once('/').unwrap();
            let (n, seq_len) = params.split_once('_').unwrap();
            let n: usize = n.strip_prefix('n').unwrap().parse().unwrap();
            let seq_len: usize = seq_len.strip_prefix('l').unwrap().parse().unwrap();

            let mu = compute_empirical_mu(&EmpiricalMu::FLUX2, seq_len, n);
            let expected_mu = read_f64(&tensors, &format!("{case}/mu"));
            assert!(
                mu.to_bits() == expected_mu.to_bits(),
                "{case} mu: expected {expected_mu:e}, got {mu:e}"
            );

            let got = schedule(n, mu, &config(config_name)).unwrap();
            assert_eq!(got.num_steps(), n);
            assert_bits_eq(
                &format!("{case} sigmas"),
                &read_f32(&tensors, &format!("{case}/sigmas")),
                &got.sigmas,
            );
            assert_bits_eq(
                &format!("{case} timesteps"),
                &read_f32(&tensors, &format!("{case}/timesteps")),
                &got.timesteps,
            );
            let transformer: Vec<f32> = (0..n).map(|i| got.transformer_timestep(i)).collect();
            assert_bits_eq(
                &format!("{case} transformer timesteps"),
                &read_f32(&tensors, &format!("{case}/transformer_timesteps")),
                &transformer,
            );
            let dt: Vec<f32> = (0..n).map(|i| got.dt(i)).collect();
            assert_bits_eq(
                &format!("{case} dt"),
                &read_f32(&tensors, &format!("{case}/dt")),
                &dt,
            );
        }
    }

    /// The reference values of the numerics contract (FLUX2-KLEIN.md section 5), given to 6
    /// decimals: tolerance 1e-6.
    #[test]
    fn contract_reference_values_for_four_steps() {
        let cases: [(usize, f64, [f32; 5]); 3] = [
            (16, 1.945216, [1.0, 0.954515, 0.874924, 0.699854, 0.0]),
            (1024, 2.030690, [1.0, 0.958085, 0.883982, 0.717497, 0.0]),
            (4096, 2.291180, [1.0, 0.967384, 0.908144, 0.767200, 0.0]),
        ];
        for (seq_len, expected_mu, expected_sigmas) in cases {
            let mu = compute_empirical_mu(&EmpiricalMu::FLUX2, seq_len, 4);
            assert!(
                (mu - expected_mu).abs() < 1e-6,
                "L={seq_len} mu: expected {expected_mu}, got {mu}"
            );
            let sigmas = schedule(4, mu, &ShiftConfig::FLUX2_KLEIN).unwrap().sigmas;
            let close = sigmas
                .iter()
                .zip(&expected_sigmas)
                .all(|(g, e)| (g - e).abs() < 1e-6);
            assert!(
                close,
                "L={seq_len} sigmas:\n  expected {expected_sigmas:?}\n  got      {sigmas:?}"
            );
        }
    }

    #[test]
    fn unsupported_options_are_refused() {
        let with = |f: fn(&mut ShiftConfig)| {
            let mut config = ShiftConfig::FLUX2_KLEIN;
            f(&mut config);
            schedule(4, 2.0, &config)
        };
        let refused = [
            with(|c| c.shift_terminal = Some(0.1)),
            with(|c| c.use_karras_sigmas = true),
            with(|c| c.use_exponential_sigmas = true),
            with(|c| c.use_beta_sigmas = true),
            with(|c| c.invert_sigmas = true),
            with(|c| c.stochastic_sampling = true),
            with(|c| c.num_train_timesteps = 0),
        ];
        for result in refused {
            assert!(
                matches!(result, Err(KleinError::Scheduler { .. })),
                "{result:?}"
            );
        }
        assert!(with(|c| c.shift_terminal = Some(0.0)).is_ok());
        assert!(matches!(
            schedule(0, 2.0, &ShiftConfig::FLUX2_KLEIN),
            Err(KleinError::Request { .. })
        ));
    }

    #[test]
    fn config_deserialises_from_the_manifest_section() {
        let json = r#"{
            "class": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000, "shift": 3.0,
            "use_dynamic_shifting": true, "time_shift_type": "exponential",
            "empirical_mu": { "a1": 8.73809524e-05, "b1": 1.89833333, "a2": 0.00016927,
                              "b2": 0.45666666, "seq_len_threshold": 4300 }
        }"#;
        let config: ShiftConfig = serde_json::from_str(json).unwrap();
        assert_eq!(config, ShiftConfig::FLUX2_KLEIN);
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        let mu: EmpiricalMu = serde_json::from_value(value["empirical_mu"].clone()).unwrap();
        assert_eq!(mu, EmpiricalMu::FLUX2);
    }

    /// A mu so large that exp(mu) overflows (or so negative that a sigma is 0/0) is refused, as
    /// Python's math.exp refuses it, rather than denoising with NaN.
    #[test]
    fn out_of_range_mu_is_refused() {
        for mu in [1e6, -1e15] {
            match schedule(4, mu, &ShiftConfig::FLUX2_KLEIN) {
                Err(KleinError::Scheduler { setting, reason }) => {
                    assert_eq!(setting, "empirical_mu");
                    assert!(reason.contains("gives sigma NaN"), "{reason}");
                }
                other => panic!("mu {mu}: expected a scheduler error, got {other:?}"),
            }
        }
    }
}
