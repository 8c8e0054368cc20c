//! The pure stages of the pipeline, each as diffusers computes it, with no ONNX Runtime: prompt
//! tokens (and the reading of `tokenizer.json`), seeded noise, latent packing and position ids,
//! the flow-matching schedule, reference preprocessing, the inpainting mask, its crop and the strength, LoRA files, the output's pixels and its step previews, and the tiles of tiled VAE runs.
pub mod inpaint;
pub mod latents;
pub mod lora;
pub mod mask;
pub mod mask_crop;
pub mod noise;
pub mod output;
pub mod preview;
pub mod reference;
pub mod schedule;
pub mod tokenize;
mod tokenizer_file;
pub mod vae_tiling;
