//! Step previews: the latents mapped linearly to RGB, one pixel per VAE latent cell (1/8 of the
//! output's side), with the manifest's `preview` map (`klein-export` fits it on the bundle's VAE:
//! export/klein_export/preview.py). A token's 128 channels are 32 VAE channels at 2x2 cells
//! (channel `c * 4 + dy * 2 + dx`); cell `(dy, dx)` is `bias[p] + sum_c weights[c*4+p] * z`, with
//! `p = dy * 2 + dx`, clipped to [0, 1]. What is previewed is the model's current estimate of the
//! clean image, `x0 = x_t - sigma_t * v`, not the noisy latents.
use ndarray::ArrayView2;
use serde::{Deserialize, Serialize};

use super::output::RgbImage;

/// The manifest's `preview` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreviewSpec {
    /// `[channels][3]`: each normalised latent channel's contribution to its cell's RGB (0-1).
    pub weights: Vec<[f32; 3]>,
    /// `[patch_size^2][3]`: each cell position's RGB offset.
    pub bias: Vec<[f32; 3]>,
    /// Root-mean-square error of the fit on its images, 0-1 (a record; not used here).
    pub fit_rmse: f64,
}

impl PreviewSpec {
    /// What is inconsistent with a bundle of `channels`-channel tokens of `cells` cells each.
    pub fn problems(&self, channels: usize, cells: usize) -> Vec<String> {
        let mut problems = Vec::new();
        if self.weights.len() != channels || self.bias.len() != cells {
            problems.push(format!(
                "preview has {} weight rows and {} biases: the latents need {channels} and {cells}",
                self.weights.len(),
                self.bias.len()
            ));
        }
        if self
            .weights
            .iter()
            .chain(&self.bias)
            .flatten()
            .any(|v| !v.is_finite())
        {
            problems.push("preview has a number that is not finite".to_string());
        }
        problems
    }
}

/// The preview of one image's packed latents `[lat_h * lat_w, channels]`: an RGB image of
/// `2 lat_w x 2 lat_h` pixels (for a patch size of 2).
pub fn preview_image(
    tokens: ArrayView2<f32>,
    lat_h: usize,
    lat_w: usize,
    spec: &PreviewSpec,
) -> RgbImage {
    let cells = spec.bias.len();
    let patch = (cells as f64).sqrt() as usize;
    let (height, width) = (lat_h * patch, lat_w * patch);
    let mut pixels = vec![0u8; height * width * 3];
    for (t, token) in tokens.outer_iter().enumerate() {
        let (i, j) = (t / lat_w, t % lat_w);
        for (p, bias) in spec.bias.iter().enumerate() {
            let mut rgb = *bias;
            for (k, weights) in spec.weights.iter().enumerate().skip(p).step_by(cells) {
                let z = token[k];
                for (out, w) in rgb.iter_mut().zip(weights) {
                    *out += w * z;
                }
            }
            let (y, x) = (i * patch + p / patch, j * patch + p % patch);
            let at = (y * width + x) * 3;
            for (c, value) in rgb.iter().enumerate() {
                pixels[at + c] = (value.clamp(0.0, 1.0) * 255.0).round() as u8;
            }
        }
    }
    RgbImage {
        width: width as u32,
        height: height as u32,
        pixels,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use ndarray::Array2;

    #[test]
    fn each_cell_reads_its_own_channels() {
        // 2 VAE channels x 4 cells = 8 token channels; channel c of cell p is index c * 4 + p.
        let mut weights = vec![[0.0f32; 3]; 8];
        weights[0] = [1.0, 0.0, 0.0]; // channel 0, cell (0, 0) -> red
        weights[4 + 3] = [0.0, 0.0, 1.0]; // channel 1, cell (1, 1) -> blue
        let spec = PreviewSpec {
            weights,
            bias: vec![[0.0, 0.5, 0.0]; 4],
            fit_rmse: 0.0,
        };
        assert!(spec.problems(8, 4).is_empty());
        assert_eq!(spec.problems(128, 4).len(), 1);
        // 1x2 tokens: the second token's values are all 1, the first's 0.5.
        let tokens = Array2::from_shape_fn((2, 8), |(t, _)| if t == 0 { 0.5 } else { 1.0 });
        let image = preview_image(tokens.view(), 1, 2, &spec);
        assert_eq!((image.width, image.height), (4, 2));
        let px = |x: usize, y: usize| &image.pixels[(y * 4 + x) * 3..(y * 4 + x) * 3 + 3];
        assert_eq!(px(0, 0), [128, 128, 0]); // red 0.5, green bias
        assert_eq!(px(1, 1), [0, 128, 128]); // blue 0.5
        assert_eq!(px(2, 0), [255, 128, 0]); // second token, red clipped at 1
        assert_eq!(px(1, 0), [0, 128, 0]); // cell (0, 1): bias only
    }
}
