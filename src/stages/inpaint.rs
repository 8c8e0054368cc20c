//! The strength and the per-step blend of diffusers' `Flux2KleinInpaintPipeline`:
//! `get_timesteps` (how many of the schedule's steps a strength runs), the scheduler's
//! `scale_noise` (the source latents noised to a sigma), and the blend after each step that keeps
//! the unmasked tokens on the source's noising path.
use ndarray::{ArrayView1, ArrayView3, ArrayViewMut3, Zip};

use crate::error::{KleinError, Result};

/// klein's default strength: 1.0, where diffusers' is 0.8. The source image is always one of the
/// transformer's reference inputs in this pipeline, so the structure survives a start from pure
/// noise, and lower strengths give klein's few-step schedules fewer steps to fix the noise they
/// add (the model's users report that values below 1 hurt edits). At 4 steps diffusers' 0.8 runs
/// the same schedule and start as 1.0 (`int(4 - 3.2) = 0` steps skipped, first sigma 1).
pub const DEFAULT_STRENGTH: f64 = 1.0;

/// A strength in (0, 1], checked without a bundle (NaN refused).
pub fn check_strength(strength: f64) -> Result<()> {
    if !(strength > 0.0 && strength <= 1.0) {
        return Err(KleinError::request_about(
            "strength",
            format!(
                "strength {strength} must be above 0 and at most 1 (1 repaints from pure noise)"
            ),
        ));
    }
    Ok(())
}

/// `get_timesteps`: the index of the first of `steps` scheduled steps that `strength` runs
/// (`int(max(steps - min(steps * strength, steps), 0))`, in f64 as Python computes it). Refuses a
/// strength outside (0, 1], and one so small that no step is left (diffusers' "< 1" error).
pub fn first_step(steps: usize, strength: f64) -> Result<usize> {
    check_strength(strength)?;
    let total = steps as f64;
    let init = (total * strength).min(total);
    let start = (total - init).max(0.0) as usize;
    if start >= steps {
        return Err(KleinError::request_about(
            "strength",
            format!(
                "strength {strength:?} with {steps} steps leaves no step to run; raise the strength"
            ),
        ));
    }
    Ok(start)
}

/// `scale_noise`: `sigma * noise + (1 - sigma) * sample` in float32, per token, where `sample`
/// (`[1, N, C]`) is shared by every image of the batch (`noise`: `[B, N, C]`).
pub fn scale_noise(
    mut out: ArrayViewMut3<f32>,
    sample: ArrayView3<f32>,
    noise: ArrayView3<f32>,
    sigma: f32,
) {
    let sample = sample
        .broadcast(noise.raw_dim())
        .unwrap_or_else(|| unreachable!("the source latents are [1, N, C] for [B, N, C] noise"));
    Zip::from(&mut out)
        .and(&noise)
        .and(&sample)
        .for_each(|o, &n, &s| *o = sigma * n + (1.0 - sigma) * s);
}

/// The blend after a step: `(1 - mask) * proper + mask * latents`, with `mask` one weight per
/// token (`[N]`), `proper` and `latents` `[B, N, C]`; writes into `latents`.
pub fn blend(mut latents: ArrayViewMut3<f32>, proper: ArrayView3<f32>, mask: ArrayView1<f32>) {
    for (mut image, proper) in latents.outer_iter_mut().zip(proper.outer_iter()) {
        for ((mut token, proper), &m) in image
            .outer_iter_mut()
            .zip(proper.outer_iter())
            .zip(mask.iter())
        {
            token.zip_mut_with(&proper, |x, &p| *x = (1.0 - m) * p + m * *x);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use ndarray::{Array1, Array3};

    #[test]
    fn first_step_is_get_timesteps() {
        // diffusers: t_start = int(max(n - min(n * s, n), 0))
        assert_eq!(first_step(4, 1.0).unwrap(), 0);
        assert_eq!(first_step(4, 0.8).unwrap(), 0);
        assert_eq!(first_step(4, 0.75).unwrap(), 1);
        assert_eq!(first_step(4, 0.6).unwrap(), 1);
        assert_eq!(first_step(4, 0.25).unwrap(), 3);
        assert_eq!(first_step(4, 0.01).unwrap(), 3);
        assert_eq!(first_step(50, 0.3).unwrap(), 35);
        // 3 * 0.7 = 2.0999999999999996 in f64: int(0.9000000000000004) = 0
        assert_eq!(first_step(3, 0.7).unwrap(), 0);
    }

    #[test]
    fn strengths_outside_the_range_are_refused() {
        for (steps, strength) in [(4, 1e-20), (4, 0.0), (4, -0.5), (4, 1.5), (4, f64::NAN)] {
            let err = first_step(steps, strength).unwrap_err().to_string();
            assert!(err.contains("strength"), "{err}");
        }
        // A tiny strength in its short form (it printed 300 digits).
        let err = first_step(4, 1e-300).unwrap_err().to_string();
        assert!(err.contains("strength 1e-300 with 4 steps"), "{err}");
    }

    #[test]
    fn blend_keeps_unmasked_tokens_and_mixes_fractions() {
        let mut latents = Array3::from_elem((2, 3, 2), 4.0f32);
        let proper = Array3::from_elem((2, 3, 2), 2.0f32);
        let mask = Array1::from(vec![0.0f32, 0.25, 1.0]);
        blend(latents.view_mut(), proper.view(), mask.view());
        for image in latents.outer_iter() {
            assert_eq!(image.column(0).to_vec(), vec![2.0, 2.5, 4.0]);
        }
    }

    #[test]
    fn scale_noise_interpolates_per_image() {
        let sample = Array3::from_elem((1, 2, 1), 10.0f32);
        let noise = Array3::from_shape_vec((2, 2, 1), vec![0.0, 1.0, 2.0, 3.0]).unwrap();
        let mut out = Array3::zeros((2, 2, 1));
        scale_noise(out.view_mut(), sample.view(), noise.view(), 0.5);
        assert_eq!(out.into_raw_vec_and_offset().0, vec![5.0, 5.5, 6.0, 6.5]);
    }
}
