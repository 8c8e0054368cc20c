"""diffusers' FLUX.3 modular pipelines on a checkpoint: the reference klein's images are checked against.

`Flux3DistilledAutoBlocks` or `Flux3AutoBlocks` (by the transformer's `flow_map`), without their
prompt upsampler step (it needs the separate Qwen3.5 upsampler model; klein encodes the prompt as
given, as the blocks do once that step is removed). Components in float32 on the CPU.
"""

import torch

from .flux3 import BASE_GUIDANCE, Flux3Checkpoint


def load_reference(root):
    """The modular pipeline of the checkpoint at `root`, with its components loaded."""
    from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks

    ckpt = Flux3Checkpoint(root)
    blocks = Flux3DistilledAutoBlocks() if ckpt.is_distilled else Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline()
    pipe.update_components(
        text_encoder=ckpt.load_text_encoder(),
        tokenizer=ckpt.load_processor(),
        transformer=ckpt.load_transformer(),
        vae=ckpt.load_vae(),
    )
    pipe.klein_out_layers = ckpt.text_encoder_out_layers
    pipe.klein_root = ckpt.root
    return pipe


def run_reference(
    pipe,
    prompt,
    seed,
    width=None,
    height=None,
    steps=None,
    guidance=None,
    negative_prompt=None,
    images=None,
    output_type="np",
    num_images=1,
):
    """One generation: float images `[B, H, W, 3]` in [0, 1] (`output_type="np"`) or PIL images."""
    from diffusers.guiders import ClassifierFreeGuidance

    kwargs = dict(
        prompt=prompt,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type=output_type,
        num_images_per_prompt=num_images,
        text_encoder_out_layers=pipe.klein_out_layers,
    )
    for key, value in (
        ("width", width),
        ("height", height),
        ("num_inference_steps", steps),
        ("negative_prompt", negative_prompt),
        ("image", images),
    ):
        if value is not None:
            kwargs[key] = value
    if not pipe.transformer.config.flow_map:
        pipe.update_components(
            guider=ClassifierFreeGuidance(guidance_scale=BASE_GUIDANCE if guidance is None else guidance)
        )
    with torch.no_grad():
        return pipe(**kwargs, output="images")
