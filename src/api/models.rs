//! OpenAI's model routes, as `klein serve` and the Ray Serve deployment (through the Python
//! bindings) both answer them: `GET /v1/models` ([`model_list`]) and `GET /v1/models/{id}`
//! ([`retrieve`]). The one model is the loaded bundle's ([`model_object`]).
use serde_json::{json, Value};

use crate::bundle::Manifest;
use crate::limits;

/// OpenAI's model object for the bundle `manifest` served as `name` (`created`: when the server
/// or pipeline started, in Unix seconds; typed clients need an integer there), with what the model
/// and the server allow under `klein` (OpenAI clients keep unknown fields): the web page shows its
/// controls from it. `max_pixels`: the server's cap on one request's pixels (`--max-pixels`);
/// `None` (null) where there is none beyond the limits on sides and images.
pub fn model_object(
    manifest: &Manifest,
    name: &str,
    created: u64,
    max_pixels: Option<u64>,
) -> Value {
    let model = &manifest.model;
    json!({
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "klein",
        "klein": {
            // "flux2" (FLUX.2-klein) or "flux3" (FLUX.3 Image Klein).
            "family": model.family,
            "distilled": model.is_distilled,
            // Base models take guidance and a negative prompt; distilled ones run without.
            "guidance": !model.is_distilled,
            "default_steps": model.default_steps,
            "default_guidance": model.default_guidance,
            "default_width": model.default_width,
            "default_height": model.default_height,
            "pixel_multiple": manifest.latents.pixel_multiple,
            "min_side": limits::MIN_SIDE,
            "max_side": limits::MAX_SIDE,
            "max_steps": limits::MAX_STEPS,
            "max_images": limits::MAX_BATCH,
            "max_references": limits::MAX_REFERENCES,
            "max_loras": limits::MAX_LORAS,
            "max_pixels": max_pixels,
        },
    })
}

/// The answer of `GET /v1/models`: the list of the one model `object`.
pub fn model_list(object: Value) -> Value {
    json!({ "object": "list", "data": [object] })
}

/// `GET /v1/models/{id}` (the OpenAI clients' `models.retrieve`): `object` when `id` is its id;
/// else the message of the answer's 404.
pub fn retrieve(object: Value, id: &str) -> Result<Value, String> {
    let name = object["id"].as_str().unwrap_or_default();
    if id == name {
        return Ok(object);
    }
    Err(format!(
        "no model `{}`; this server has `{name}`",
        id.chars().take(64).collect::<String>()
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn only_the_models_own_id_is_found() {
        let object = json!({ "id": "klein-tiny", "object": "model" });
        assert_eq!(retrieve(object.clone(), "klein-tiny").unwrap(), object);
        let long = "x".repeat(100);
        let message = retrieve(object.clone(), &long).unwrap_err();
        assert!(message.contains(&"x".repeat(64)) && !message.contains(&"x".repeat(65)));
        assert!(
            message.ends_with("this server has `klein-tiny`"),
            "{message}"
        );
        assert_eq!(model_list(object.clone())["data"][0], object);
    }
}
