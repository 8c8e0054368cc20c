//! `klein info`: what a bundle holds, what it needs, and how this machine will run it.

use klein::bundle::manifest::QuantizationSpec;
use klein::bundle::Manifest;

use crate::args::{default_model, InfoArgs};
use klein::pipeline::metadata::variant_name;

pub(crate) fn info(args: InfoArgs) -> anyhow::Result<()> {
    let model = default_model(args.model)?;
    let manifest = Manifest::load(&model)?;
    if args.verify {
        manifest.verify_hashes(&model)?;
    }
    let loras = klein::pipeline::lora::inspect(&args.loras, &manifest, &model)?;
    let m = &manifest.model;
    println!("bundle:       {}", model.display());
    println!(
        "model:        {} ({}, variant {}, {}{})",
        m.name,
        m.family.label(),
        variant_name(m.variant),
        if m.is_distilled { "distilled" } else { "base" },
        if m.kv_cache {
            ", KV: reference K/V cached after the first step"
        } else {
            ""
        }
    );
    println!(
        "defaults:     {} steps, guidance {}, {}x{}",
        m.default_steps, m.default_guidance, m.default_width, m.default_height
    );
    if let Some(source) = &m.transformer_file {
        println!(
            "weights:      transformer from {} (sha256 {})",
            source.file, source.sha256
        );
    }
    for lora in &m.loras {
        println!(
            "merged LoRA:  {} at {} (sha256 {})",
            lora.source.file, lora.scale, lora.source.sha256
        );
    }
    let te = &manifest.text_encoder;
    println!(
        "text encoder: hidden {}, layers {:?} of {} ({} in the graph), embeddings {}",
        te.hidden_size, te.hidden_layers, te.num_hidden_layers, te.layers_in_graph, te.embed_dim
    );
    let tr = &manifest.transformer;
    let (first, joint) = match m.family {
        klein::bundle::ModelFamily::Flux2 => ("double", "single"),
        klein::bundle::ModelFamily::Flux3 => ("per-mode", "joint"),
    };
    println!(
        "transformer:  {} {first} + {} {joint} blocks, {} heads x {}, joint dim {}",
        tr.num_layers,
        tr.num_single_layers,
        tr.num_attention_heads,
        tr.attention_head_dim,
        tr.joint_attention_dim
    );
    let window = match manifest.tokenizer.pad_multiple {
        Some(m) => format!(
            "windows of multiples of {m} tokens up to {}",
            manifest.tokenizer.max_sequence_length
        ),
        None => format!("max {} tokens", manifest.tokenizer.max_sequence_length),
    };
    println!(
        "tokenizer:    pad {:?} ({}), {window}",
        manifest.tokenizer.pad_token, manifest.tokenizer.pad_token_id,
    );
    println!("graphs:");
    for (name, spec) in manifest.graphs.iter() {
        // The graph, its external data and, in static-shape bundles, every bucket's graph and
        // the shared weights: the files named `<component>.*`.
        let bytes: u64 = manifest
            .files
            .iter()
            .filter(|(file, _)| file.starts_with(&format!("{name}.")))
            .map(|(_, f)| f.bytes)
            .sum();
        let quant = spec
            .quantization
            .as_ref()
            .map_or_else(|| "not quantized".to_string(), describe_quantization);
        println!(
            "  {name:13} {:>10.1} MB  {}  {quant}",
            bytes as f64 / 1e6,
            spec.precision
        );
    }
    println!("cpu:          {}", klein::runtime::detected_features());
    if let Some(kernels) = klein::bundle::support::cpu_int8_kernels(&manifest.graphs) {
        println!("int8 kernels: {kernels}");
    }
    if let Some(shapes) = &manifest.static_shapes {
        println!(
            "static shapes: {} (batch {}, {} tokens, {} reference(s) of the output's size)",
            shapes.sizes(),
            shapes.batch,
            shapes.seq,
            shapes.refs
        );
    }
    let e = &manifest.exporter;
    println!(
        "exported by:  {} {} (torch {}, diffusers {}, opset {})",
        e.name, e.version, e.torch, e.diffusers, e.opset
    );
    println!(
        "needs:        ONNX Runtime >= {}",
        manifest.min_onnxruntime_version
    );
    // The library `generate` would load (default search), and whether it is new enough.
    match klein::runtime::init(klein::runtime::RuntimeOptions::default()) {
        Ok(runtime) => {
            let release = runtime
                .version
                .map_or("of no stated release".to_string(), |v| v.to_string());
            let verdict = match manifest.check_runtime(runtime, &model) {
                Ok(()) => "can run this bundle",
                Err(_) => "TOO OLD for this bundle",
            };
            println!(
                "runtime:      ONNX Runtime {release} ({}, {}): {verdict}",
                runtime.library.display(),
                runtime.source
            );
        }
        Err(error) => println!("runtime:      none usable: {error}"),
    }
    if args.verify {
        println!(
            "hashes:       all {} files match the manifest",
            manifest.files.len()
        );
    }
    if let Some(targets) = &manifest.graphs.transformer.lora_targets {
        println!("LoRA map:     {} linear layers", targets.len());
    }
    for lora in &loras {
        crate::report::print_lora(lora);
    }
    Ok(())
}

/// A graph's quantization in words: its kind (with the `klein-export quantize` flags that write
/// it), its weights' codes and how many operators it quantized.
fn describe_quantization(q: &QuantizationSpec) -> String {
    let nodes = q
        .extra
        .get("quantized_nodes")
        .and_then(serde_json::Value::as_u64);
    let codes = if q.reduce_range { "7-bit" } else { "8-bit" };
    let mut text = match q.method.as_str() {
        "DynamicQuantizeMatMul" => format!(
            "int8 weights and activations (--method dynamic), {codes} codes per output channel"
        ),
        "QDQ" => format!("int8 convolutions (--method static), {codes} codes per output channel"),
        "MatMulNBits" => {
            let mut words = format!("int{} weights (MatMulNBits)", q.bits);
            if let Some(block) = q.block_size {
                words += &format!(", blocks of {block}");
            }
            if let Some(symmetric) = q.symmetric {
                words += if symmetric {
                    ", symmetric"
                } else {
                    ", asymmetric"
                };
            }
            if let Some(level) = q.accuracy_level.filter(|&l| l > 0) {
                words += &format!(", accuracy level {level}");
            }
            words
        }
        other => format!("{other}, {} bits", q.bits),
    };
    if let Some(nodes) = nodes {
        text += &format!(", {nodes} operators");
    }
    text
}
