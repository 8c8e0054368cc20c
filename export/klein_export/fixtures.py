"""Reference fixtures for the runtime's tests, produced by diffusers' own `Flux2KleinPipeline`.

For each case: `case.json` (prompt, seed, size, steps, reference files) and `tensors.safetensors` with
the token ids and mask, prompt embeddings, initial noise, reference tokens, sigmas, timesteps, the
packed latents after every step and the final uint8 image. Reference images are written beside them:
PNG files, or, where a case gives a reference save options (`format`, Pillow's `save` options, and
`orientation` for an EXIF orientation tag), JPEG or WebP files, which the pipeline reads through
`load_image` like any user's photo.
"""

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from .atomic import atomic_directory, check_output
from .checkpoint import DEFAULT_OUT_LAYERS, Checkpoint

CASES = (
    {
        "name": "t2i_square",
        "prompt": "a raccoon astronaut on the moon",
        "seed": 42,
        "width": 64,
        "height": 64,
        "steps": 4,
        "refs": [],
    },
    {
        "name": "t2i_nonsquare",
        "prompt": "a red fox in the snow, watercolor",
        "seed": 7,
        "width": 80,
        "height": 48,
        "steps": 4,
        "refs": [],
    },
    {
        "name": "edit_one_ref",
        "prompt": "make it an 80s ski photo",
        "seed": 3,
        "width": None,
        "height": None,
        "steps": 4,
        "refs": [(96, 64, "RGB")],
    },
    {
        "name": "compose_three_refs",
        "prompt": "the person in the scene",
        "seed": 11,
        "width": 64,
        "height": 64,
        "steps": 3,
        "refs": [(64, 80, "RGBA"), (112, 64, "RGB"), (72, 72, "L")],
    },
    # Camera-like files: a baseline 4:2:0 JPEG; a lossy WebP and a JPEG with EXIF orientation 6.
    {
        "name": "edit_jpeg_ref",
        "prompt": "the same street at night",
        "seed": 5,
        "width": None,
        "height": None,
        "steps": 4,
        "refs": [(150, 90, "RGB", {"format": "JPEG", "quality": 88, "subsampling": 2})],
    },
    {
        "name": "edit_webp_and_rotated_jpeg",
        "prompt": "put the cat in the garden",
        "seed": 9,
        "width": None,
        "height": None,
        "steps": 3,
        "refs": [
            (96, 80, "RGB", {"format": "WEBP", "quality": 80}),
            (100, 72, "RGB", {"format": "JPEG", "quality": 90, "orientation": 6}),
        ],
    },
)

EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}


def synthetic_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """A deterministic image with gradients, a disc and noise, so every pixel position matters."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 127 + 120 * np.sin(x / (3 + seed % 5)) * np.cos(y / 7)
    g = 255 * x / max(width - 1, 1)
    b = np.where((x - width / 3) ** 2 + (y - height / 2) ** 2 < (min(width, height) / 4) ** 2, 230, 40)
    rgb = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (height, width, 3))
    image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray((255 * (x / max(width - 1, 1))).astype(np.uint8), "L")
        image.putalpha(alpha)
    elif mode == "L":
        image = image.convert("L")
    return image


def _condition_images(pipe, images):
    """The pipeline's own step 4 ("process images"), reproduced to capture the reference tokens."""
    out = []
    for img in images:
        pipe.image_processor.check_image_input(img)
        w, h = img.size
        if w * h > 1024 * 1024:
            img = pipe.image_processor._resize_to_target_area(img, 1024 * 1024)
            w, h = img.size
        m = pipe.vae_scale_factor * 2
        out.append(pipe.image_processor.preprocess(img, height=(h // m) * m, width=(w // m) * m, resize_mode="crop"))
    return out


def tokenize(tokenizer, prompt: str, max_length: int = 512):
    """Exactly `Flux2KleinPipeline._get_qwen3_prompt_embeds`'s tokenisation."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    enc = tokenizer(text, return_tensors="pt", padding="max_length", truncation=True, max_length=max_length)
    return enc["input_ids"], enc["attention_mask"]


def run_case(pipe, case: dict, out_dir: Path, out_layers=DEFAULT_OUT_LAYERS) -> dict:
    """Runs one case through the pipeline (the checkpoint's text encoder `out_layers`) and writes its
    fixture directory."""
    from diffusers.utils import load_image
    from diffusers.utils.torch_utils import randn_tensor

    out_dir.mkdir(parents=True, exist_ok=True)
    ref_files = []
    for i, (w, h, mode, *save) in enumerate(case["refs"]):
        options = dict(save[0]) if save else {"format": "PNG"}
        name = f"ref{i}.{EXTENSIONS[options['format']]}"
        if orientation := options.pop("orientation", None):
            exif = Image.Exif()
            exif[0x0112] = orientation
            options["exif"] = exif.tobytes()
        synthetic_image(w, h, mode, seed=case["seed"] * 10 + i).save(out_dir / name, **options)
        ref_files.append(name)
    images = [load_image(str(out_dir / name)) for name in ref_files]

    captured = []

    def on_step_end(_pipe, _i, _t, kwargs):
        captured.append(kwargs["latents"].clone())
        return kwargs

    with torch.no_grad():
        result = pipe(
            image=images or None,
            prompt=case["prompt"],
            height=case["height"],
            width=case["width"],
            num_inference_steps=case["steps"],
            generator=torch.Generator("cpu").manual_seed(case["seed"]),
            callback_on_step_end=on_step_end,
            guidance_scale=1.0,
            output_type="pil",
            text_encoder_out_layers=tuple(out_layers),
        )
        image = np.array(result.images[0])
        height, width = image.shape[:2]
        ids, mask = tokenize(pipe.tokenizer, case["prompt"])
        embeds, _ = pipe.encode_prompt(case["prompt"], text_encoder_out_layers=tuple(out_layers))
        shape = (1, pipe.transformer.config.in_channels, height // 16, width // 16)
        noise = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(case["seed"]), dtype=torch.float32)
        tensors = {
            "input_ids": ids.contiguous(),
            "attention_mask": mask.contiguous(),
            "prompt_embeds": embeds.contiguous(),
            "noise": noise.contiguous(),
            "sigmas": pipe.scheduler.sigmas.to(torch.float32).contiguous(),
            "timesteps": pipe.scheduler.timesteps.to(torch.float32).contiguous(),
            "image": torch.from_numpy(image.copy()),
        }
        for i, latents in enumerate(captured):
            tensors[f"latents_step{i}"] = latents.contiguous()
        if images:
            ref_tokens, ref_ids = pipe.prepare_image_latents(
                _condition_images(pipe, images), 1, None, torch.device("cpu"), torch.float32
            )
            tensors["ref_tokens"] = ref_tokens.contiguous()
            tensors["ref_ids"] = ref_ids[0].contiguous()
    save_file(tensors, str(out_dir / "tensors.safetensors"))
    meta = {
        "prompt": case["prompt"],
        "seed": case["seed"],
        "width": width,
        "height": height,
        "steps": case["steps"],
        "refs": ref_files,
    }
    (out_dir / "case.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _holds_fixtures(directory: Path) -> bool:
    """Whether `directory` holds only fixture cases (what `--force` may replace)."""
    return all(child.is_dir() and (child / "case.json").is_file() for child in directory.iterdir())


def write_fixtures(checkpoint, out_dir, cases=CASES, force=False, log=print):
    """Writes every case under `out_dir`, whole or not at all: an existing `out_dir` is refused unless
    `force`, and then replaced only once every case has been written."""
    from .diffusers_reference import load_pipeline

    out_dir = Path(out_dir)
    check_output(out_dir, force, [(checkpoint, "the checkpoint")], replaceable=_holds_fixtures)
    pipe = load_pipeline(checkpoint)
    layers = Checkpoint(checkpoint).text_encoder_out_layers
    with atomic_directory(out_dir) as tmp:
        for case in cases:
            meta = run_case(pipe, case, tmp / case["name"], layers)
            log(f"{case['name']}: {meta['width']}x{meta['height']}, {len(meta['refs'])} reference(s)")
