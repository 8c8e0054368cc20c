"""A diffusers FLUX.3 Image Klein checkpoint on disk: how it is recognised, checked and loaded.

diffusers 0.42.1 runs FLUX.3 as modular pipelines (`diffusers/modular_pipelines/flux3/`):
`Flux3DistilledModularPipeline` for the step-distilled checkpoints (`flow_map: true` in the
transformer's config: 16 steps, no guidance) and `Flux3ModularPipeline` for the base ones (50 steps,
classifier-free guidance 3.5). The numbers of the recipe below are the defaults of those blocks.

A checkpoint holds `text_encoder/` (Qwen3-VL, of which only the text path is used), `tokenizer/` (its
processor: `processor_config.json` and `chat_template.jinja`, or the older `preprocessor_config.json`
and `chat_template.json`), `transformer/`, `vae/` (FLUX.2's autoencoder) and a pipeline index
(`modular_model_index.json` as `ModularPipeline.save_pretrained` writes it, or `model_index.json`). A
`scheduler/` folder is read when present, not required: the recipe's scheduler is fixed.
"""

from pathlib import Path

import torch

from .checkpoint import _check_header, _stored_shapes, check_complete, weight_files
from .config_values import CONFIG_VALUES, check_config_values
from .errors import CheckpointError, first_names
from .jsonfile import read_json

FAMILY = "flux3"
# Flux3TextEncoderStep: the text window is padded to a multiple of 80 tokens, up to 8192.
PAD_MULTIPLE = 80
MAX_SEQUENCE_LENGTH = 8192
# Flux3TextEncoderStep's `text_encoder_out_layers` default (stacked hidden states).
DEFAULT_OUT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)
OUT_LAYERS_KEY = "text_encoder_out_layers"
# Flux3SetTimestepsStep: a constant shift on FlowMatchEulerDiscreteScheduler, 50 or 16 steps.
SHIFT = 6.93
DISTILLED_STEPS, BASE_STEPS = 16, 50
# Flux3LoopDenoiser's ClassifierFreeGuidance default (BFL's README says 4; diffusers' 3.5 is kept).
BASE_GUIDANCE = 3.5
# Flux3PrepareLatentsStep: 1024x1024 by default; the image H/W position ids are scaled by 0.5.
DEFAULT_SIDE = 1024
IMAGE_ROPE_SCALE = 0.5

TRANSFORMER_CLASS = "Flux3Transformer2DModel"
TEXT_ENCODER_CLASS = "Qwen3VLForConditionalGeneration"
INDEX_FILES = ("modular_model_index.json", "model_index.json")
# The tokenizer folder's files, by layout: either gives AutoProcessor what Qwen3VLProcessor needs.
PROCESSOR_FILES = (("processor_config.json", "chat_template.jinja"), ("preprocessor_config.json", "chat_template.json"))

TEXT_CONFIG_VALUES = dict(CONFIG_VALUES["text_encoder"])
TRANSFORMER_VALUES = {
    key: CONFIG_VALUES["transformer"][key]
    for key in ("attention_head_dim", "num_attention_heads", "num_layers", "num_single_layers", "joint_attention_dim")
} | {"in_channels": "a positive whole number", "cond_in_channels": "a positive whole number"}


def is_flux3(root) -> bool:
    """Whether the diffusers checkpoint at `root` is a FLUX.3 one: its transformer's config names
    Flux3Transformer2DModel."""
    config = Path(root) / "transformer" / "config.json"
    if not config.is_file():
        return False
    try:
        return read_json(config, CheckpointError, "").get("_class_name") == TRANSFORMER_CLASS
    except CheckpointError:
        return False


def _read_json(path: Path) -> dict:
    return read_json(path, CheckpointError, "a diffusers FLUX.3 Image Klein checkpoint has this file")


class Flux3Checkpoint:
    """Reads and checks the pipeline index and every component's config."""

    family = FAMILY
    is_kv = False
    transformer_file = None

    def __init__(self, root):
        self.root = Path(root)
        self.arguments = (FAMILY, str(self.root))
        if not self.root.is_dir():
            what = "not a directory" if self.root.exists() else "no such directory"
            raise CheckpointError(f"{self.root}: {what} (expected a diffusers checkpoint)")
        index = next((self.root / name for name in INDEX_FILES if (self.root / name).is_file()), None)
        if index is None:
            raise CheckpointError(f"{self.root}: no {' or '.join(INDEX_FILES)} (not a diffusers checkpoint)")
        self.index_path = index
        self.index = _read_json(index)
        for component in ("text_encoder", "tokenizer", "transformer", "vae"):
            if not (self.root / component).is_dir():
                raise CheckpointError(f"{self.root / component}: missing component directory")
        te = _read_json(self.root / "text_encoder" / "config.json")
        if te.get("architectures") and TEXT_ENCODER_CLASS not in te["architectures"]:
            raise CheckpointError(
                f"{self.root / 'text_encoder' / 'config.json'}: architectures {te['architectures']}, expected "
                f"{TEXT_ENCODER_CLASS} (FLUX.3 Image Klein's text encoder)"
            )
        if not isinstance(te.get("text_config"), dict):
            raise CheckpointError(
                f"{self.root / 'text_encoder' / 'config.json'}: no text_config (a Qwen3-VL config has one)"
            )
        self.vl_config = te
        self.text_encoder_config = te["text_config"]
        self.transformer_config = _read_json(self.root / "transformer" / "config.json")
        self.vae_config = _read_json(self.root / "vae" / "config.json")
        for path, config, values in (
            (self.root / "text_encoder" / "config.json", self.text_encoder_config, TEXT_CONFIG_VALUES),
            (self.root / "transformer" / "config.json", self.transformer_config, TRANSFORMER_VALUES),
            (self.root / "vae" / "config.json", self.vae_config, CONFIG_VALUES["vae"]),
        ):
            check_config_values(path, config, values)
        flow_map = self.transformer_config.get("flow_map", False)
        if not isinstance(flow_map, bool):
            raise CheckpointError(
                f"{self.root / 'transformer' / 'config.json'}: flow_map is {flow_map!r}; true or false"
            )
        self.is_distilled = flow_map
        for component in ("text_encoder", "transformer", "vae"):
            weights = weight_files(self.root / component)
            if not weights:
                raise CheckpointError(f"{self.root / component}: no *.safetensors weights")
            for path in weights:
                _check_header(path)
        tokenizer = self.root / "tokenizer"
        if not (tokenizer / "tokenizer.json").is_file():
            raise CheckpointError(f"{tokenizer / 'tokenizer.json'}: missing (a fast tokenizer file is required)")
        if not any(all((tokenizer / name).is_file() for name in layout) for layout in PROCESSOR_FILES):
            layouts = " or ".join(" + ".join(layout) for layout in PROCESSOR_FILES)
            raise CheckpointError(
                f"{tokenizer}: no Qwen3-VL processor files ({layouts}): the prompt is rendered with its chat template"
            )
        self.text_encoder_out_layers = self._out_layers()

    def _out_layers(self) -> tuple:
        """The stacked hidden layers: the pipeline's default, or the index's `text_encoder_out_layers`
        (test checkpoints narrower than the published one record theirs there), checked against the
        text encoder's depth and the transformer's `joint_attention_dim`."""
        layers = self.index.get(OUT_LAYERS_KEY, list(DEFAULT_OUT_LAYERS))
        if not (isinstance(layers, list) and layers and all(type(k) is int for k in layers)):
            raise CheckpointError(
                f"{self.index_path}: {OUT_LAYERS_KEY} must be a list of layer numbers, not {layers!r}"
            )
        depth, hidden = (
            self.text_encoder_config.get("num_hidden_layers", 0),
            self.text_encoder_config.get("hidden_size"),
        )
        bad = [k for k in layers if not 1 <= k <= depth]
        if bad:
            raise CheckpointError(
                f"{self.root}: text encoder out layers {layers} include {bad}, outside 1..{depth} "
                f"(text_encoder/config.json's text_config has num_hidden_layers {depth})"
            )
        joint = self.transformer_config.get("joint_attention_dim")
        if hidden is None or joint != hidden * len(layers):
            raise CheckpointError(
                f"{self.root}: the text encoder's hidden_size {hidden} x {len(layers)} out layers = "
                f"{hidden * len(layers) if hidden else '?'}, but transformer/config.json has joint_attention_dim "
                f"{joint}: the text encoder and the transformer are of different models (FLUX.3 Image Klein: "
                "2560 x 8 = 20480)"
            )
        return tuple(layers)

    def check_weights(self):
        """The transformer's and VAE's files hold exactly the weights their configs give (from the
        headers, on weightless models), and the text encoder's hold the language model's."""
        from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel

        builders = {
            "transformer": lambda: Flux3Transformer2DModel.from_config(self.transformer_config),
            "vae": lambda: AutoencoderKLFlux2.from_config(self.vae_config),
        }
        for component, build in builders.items():
            try:
                with torch.device("meta"):
                    model = build()
            except Exception as e:
                raise CheckpointError(
                    f"{self.root / component / 'config.json'}: the library cannot build the {component} from it "
                    f"({type(e).__name__}: {e})"
                ) from None
            stored = _stored_shapes(self.root / component)
            wanted = {k: list(t.shape) for k, t in model.state_dict().items()}
            missing = [k for k in wanted if k not in stored]
            check_complete(self.root / component, None, missing)
            wrong = [f"{k} is {stored[k]}, config.json gives {w}" for k, w in wanted.items() if stored[k] != w]
            extra = sorted(set(stored) - set(wanted))
            if wrong or extra:
                raise CheckpointError(
                    f"{self.root / component}: {len(wrong)} weights of another shape, {len(extra)} without a place "
                    f"({first_names(wrong + extra)}): config.json and the weights are of different models"
                )

    def load_text_encoder(self, num_layers=None):
        """Qwen3-VL in float32; with `num_layers`, only the language model's first layers are built."""
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
        from transformers.utils import logging

        config = Qwen3VLConfig.from_pretrained(self.root / "text_encoder")
        if num_layers is not None:
            config.text_config.num_hidden_layers = num_layers
            if getattr(config.text_config, "layer_types", None):
                config.text_config.layer_types = config.text_config.layer_types[:num_layers]
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # the skipped layers' weights would be reported as unexpected keys
        try:
            return self._load(
                lambda: Qwen3VLForConditionalGeneration.from_pretrained(
                    self.root / "text_encoder", config=config, dtype=torch.float32, output_loading_info=True
                ),
                "text_encoder",
                unused=("lm_head.weight",),
            )
        finally:
            logging.set_verbosity(verbosity)

    def load_transformer(self):
        from diffusers import Flux3Transformer2DModel

        return self._load(
            lambda: Flux3Transformer2DModel.from_pretrained(
                self.root / "transformer", torch_dtype=torch.float32, output_loading_info=True
            ),
            "transformer",
        )

    def load_vae(self):
        from diffusers import AutoencoderKLFlux2

        return self._load(
            lambda: AutoencoderKLFlux2.from_pretrained(
                self.root / "vae", torch_dtype=torch.float32, output_loading_info=True
            ),
            "vae",
        )

    def load_processor(self):
        """The Qwen3-VL processor, as diffusers' `ComponentSpec("tokenizer", AutoProcessor)` loads it."""
        from transformers import AutoProcessor

        return self._load(lambda: (AutoProcessor.from_pretrained(self.root / "tokenizer"), None), "tokenizer")

    def _load(self, loader, component, unused=()):
        try:
            model, info = loader()
        except Exception as e:
            raise CheckpointError(f"{self.root / component}: could not be loaded ({type(e).__name__}: {e})") from e
        # The vision tower is never used: weights it lacks do not matter; the language model's do.
        missing = [k for k in (info or {}).get("missing_keys", ()) if k not in unused and "visual" not in k]
        check_complete(self.root / component, model if not missing else None, missing)
        if hasattr(model, "eval"):
            model.eval()
        return model
