"""A diffusers-format FLUX.2-klein checkpoint on disk: validation and per-component loading.

Every architecture number comes from the checkpoint's own config files. Components are loaded one at
a time so that a caller can export and free each before the next (the 4B does not fit otherwise).
"""

import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import single_file
from .config_values import CONFIG_VALUES, check_config_values
from .errors import CheckpointError, first_names
from .jsonfile import read_json

# Flux2KleinPipeline's `text_encoder_out_layers` default: the hidden layers whose outputs are
# concatenated into the prompt embeddings. A checkpoint that needs others records them in
# model_index.json under OUT_LAYERS_KEY (the pipeline's own argument name).
DEFAULT_OUT_LAYERS = (9, 18, 27)
OUT_LAYERS_KEY = "text_encoder_out_layers"

# Text encoder weights the export never reads (the output head and the final norm: the prompt is
# hidden states of earlier layers), so a checkpoint may leave them out.
TEXT_ENCODER_UNUSED = ("lm_head.weight", "model.norm.weight")

# The plain klein pipeline, and the KV variant's (reference K/V cached after the first step).
PIPELINE_CLASSES = ("Flux2KleinPipeline", "Flux2KleinKVPipeline")
EXPECTED_CLASSES = {
    "text_encoder": ("Qwen3ForCausalLM",),
    "transformer": ("Flux2Transformer2DModel",),
    "vae": ("AutoencoderKLFlux2",),
    "scheduler": ("FlowMatchEulerDiscreteScheduler",),
    "tokenizer": ("Qwen2Tokenizer", "Qwen2TokenizerFast"),
}


def _read_json(path: Path) -> dict:
    return read_json(path, CheckpointError, "a diffusers FLUX.2-klein checkpoint has this file")


def _check_header(path: Path) -> None:
    """A truncated or corrupt weights file, found before any export starts: the safetensors
    header is read and its tensors' byte ranges checked against the file's length (no data read)."""
    try:
        with safe_open(path, "pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); copy or download it again") from None


def weight_files(folder: Path) -> list:
    """The weights diffusers and transformers load from `folder` when no variant is asked for: every
    `*.safetensors`, shards included, but variants such as `diffusion_pytorch_model.fp16.safetensors`."""
    return sorted(p for p in folder.glob("*.safetensors") if "." not in p.name.removesuffix(".safetensors"))


def _stored_shapes(folder: Path) -> dict:
    """name -> shape of every tensor in `folder`'s weights, from the headers (no data read)."""
    shapes = {}
    for path in weight_files(folder):
        with safe_open(path, "pt") as f:
            names = f.keys()
            shapes.update((name, list(f.get_slice(name).get_shape())) for name in names)
    return shapes


class Checkpoint:
    """Reads and checks `model_index.json` and every component's config."""

    def __init__(self, root, transformer_file=None):
        """`transformer_file`: the transformer's weights from that one .safetensors file instead of
        `root/transformer`'s (single_file.py); its config is still the checkpoint's."""
        self.root = Path(root)
        self.transformer_file = None if transformer_file is None else Path(transformer_file)
        # What rebuilds this checkpoint in another process (an export's worker).
        self.arguments = (str(self.root), None if transformer_file is None else str(transformer_file))
        if not self.root.is_dir():
            what = "not a directory" if self.root.exists() else "no such directory"
            raise CheckpointError(f"{self.root}: {what} (expected a diffusers checkpoint)")
        self.model_index = _read_json(self.root / "model_index.json")
        pipeline_class = self.model_index.get("_class_name")
        if pipeline_class not in PIPELINE_CLASSES:
            raise CheckpointError(
                f"{self.root / 'model_index.json'}: _class_name is {pipeline_class!r}, "
                f"expected one of {PIPELINE_CLASSES}"
            )
        for component, classes in EXPECTED_CLASSES.items():
            entry = self.model_index.get(component)
            if not (isinstance(entry, list) and len(entry) == 2):  # ["library", "ClassName"]
                entry = None
            if not entry or entry[1] not in classes:
                found = entry[1] if entry else None
                raise CheckpointError(
                    f"{self.root / 'model_index.json'}: component {component!r} is {found!r}, expected one of {classes}"
                )
            if not (self.root / component).is_dir():
                raise CheckpointError(f"{self.root / component}: missing component directory")
        self.text_encoder_config = _read_json(self.root / "text_encoder" / "config.json")
        self.transformer_config = _read_json(self.root / "transformer" / "config.json")
        self.vae_config = _read_json(self.root / "vae" / "config.json")
        for component, config in (
            ("text_encoder", self.text_encoder_config),
            ("transformer", self.transformer_config),
            ("vae", self.vae_config),
        ):
            check_config_values(self.root / component / "config.json", config, CONFIG_VALUES[component])
        # A diffusers config names its class; one of another model is another checkpoint's.
        for component, config in (("transformer", self.transformer_config), ("vae", self.vae_config)):
            named, expected = config.get("_class_name"), self.model_index[component][1]
            if named is not None and named != expected:
                raise CheckpointError(
                    f"{self.root / component / 'config.json'}: _class_name is {named!r}, but model_index.json "
                    f"gives {expected!r} for {component!r}: is this component from another model?"
                )
        rope, head = self.transformer_config.get("axes_dims_rope"), self.transformer_config.get("attention_head_dim")
        if isinstance(rope, list) and isinstance(head, int) and sum(rope) != head:
            raise CheckpointError(
                f"{self.root / 'transformer' / 'config.json'}: axes_dims_rope {rope} sums to {sum(rope)}, but "
                f"attention_head_dim is {head}: the rotary embedding covers a whole head (diffusers' forward "
                "fails otherwise)"
            )
        self.scheduler_config = _read_json(self.root / "scheduler" / "scheduler_config.json")
        # With a single-file transformer, the checkpoint's own transformer weights are never read.
        components = ("text_encoder", "vae") if self.transformer_file else ("text_encoder", "transformer", "vae")
        for component in components:
            weights = weight_files(self.root / component)
            if not weights:
                variants = ", ".join(sorted(p.name for p in (self.root / component).glob("*.safetensors")))
                asked = f" but variants ({variants}), which diffusers loads only when asked" if variants else ""
                raise CheckpointError(f"{self.root / component}: no *.safetensors weights{asked}")
            for path in weights:
                _check_header(path)
        if not (self.root / "tokenizer" / "tokenizer.json").is_file():
            raise CheckpointError(
                f"{self.root / 'tokenizer' / 'tokenizer.json'}: missing (a fast tokenizer file is required)"
            )
        self._check_chat_template()
        self._check_scheduler()
        self.text_encoder_out_layers = self._out_layers()

    def check_weights(self):
        """Every weight the export reads is in the files with the shape the configs give it, and the
        transformer's and VAE's files hold nothing their configs have no place for: a config of another
        size, or weights of another model, found in seconds (on weightless copies of the models, from
        the files' headers), not when the component loads after the text encoder's export."""
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
        from transformers import Qwen3Config, Qwen3ForCausalLM

        layers = max(self.text_encoder_out_layers)

        def text_encoder():
            te = dict(self.text_encoder_config, num_hidden_layers=layers)
            if te.get("layer_types"):
                te["layer_types"] = te["layer_types"][:layers]
            return Qwen3ForCausalLM(Qwen3Config.from_dict(te))

        builders = {
            "text_encoder": text_encoder,
            "transformer": lambda: Flux2Transformer2DModel.from_config(self.transformer_config),
            "vae": lambda: AutoencoderKLFlux2.from_config(self.vae_config),
        }
        models = {}
        for component, build in builders.items():
            # A config value no check above covers (a block type, an activation) that the library
            # cannot build a model from: named, not a traceback.
            try:
                with torch.device("meta"):
                    models[component] = build()
            except Exception as e:
                raise CheckpointError(
                    f"{self.root / component / 'config.json'}: the library cannot build the {component} from it "
                    f"({type(e).__name__}: {e}); is a value of another type or model?"
                ) from None
        for component, model in models.items():
            single = component == "transformer" and self.transformer_file is not None
            where = self.transformer_file if single else self.root / component
            stored = single_file.stored_shapes(where) if single else _stored_shapes(where)
            config = "the checkpoint's transformer config.json" if single else "its config.json"
            wanted = {k: list(t.shape) for k, t in model.state_dict().items() if k not in TEXT_ENCODER_UNUSED}
            missing = [k for k in wanted if k not in stored]
            check_complete(where, None, missing)
            wrong = [f"{k} is {stored[k]}, config.json gives {want}" for k, want in wanted.items() if stored[k] != want]
            # The text encoder's files hold the layers after the last one read, and its output head.
            extra = [] if component == "text_encoder" else sorted(set(stored) - set(wanted))
            if wrong or extra:
                problem = f"{len(wrong)} weights have another shape ({first_names(wrong)})" if wrong else ""
                problem += "; " if wrong and extra else ""
                problem += f"{len(extra)} weights have no place in the model ({first_names(extra)})" if extra else ""
                raise CheckpointError(
                    f"{where}: {problem}: {config} and these weights are of different models "
                    "(a config of another size, or a file of another checkpoint?)"
                )

    def _check_chat_template(self):
        """The tokenizer's settings, with the chat template every prompt is rendered with (in
        tokenizer_config.json, or beside it in chat_template.jinja or chat_template.json)."""
        tokenizer = self.root / "tokenizer"
        settings = _read_json(tokenizer / "tokenizer_config.json")
        beside = [tokenizer / name for name in ("chat_template.jinja", "chat_template.json")]
        if not settings.get("chat_template") and not any(path.is_file() for path in beside):
            raise CheckpointError(
                f"{tokenizer}: no chat template (tokenizer_config.json has no chat_template, and there is no "
                "chat_template.jinja): Flux2KleinPipeline renders every prompt with Qwen3's; copy the "
                "checkpoint's tokenizer folder again"
            )

    def _out_layers(self) -> tuple:
        """The hidden layers the pipeline concatenates, checked against the text encoder's depth and
        the transformer's `joint_attention_dim` (which must be their number x the hidden size)."""
        index = self.root / "model_index.json"
        layers = self.model_index.get(OUT_LAYERS_KEY, list(DEFAULT_OUT_LAYERS))
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in layers)
        ):
            raise CheckpointError(
                f"{index}: {OUT_LAYERS_KEY} must be a non-empty list of layer numbers, not {layers!r}"
            )
        te, tr = self.text_encoder_config, self.transformer_config
        depth = te.get("num_hidden_layers", 0)
        bad = [k for k in layers if not 1 <= k < depth]
        if bad:
            # Layer `depth` is excluded too: transformers returns the final-normed output as the last
            # layer's hidden state, the exporter's truncated encoder the raw one.
            raise CheckpointError(
                f"{index}: text encoder out layers {layers} include {bad}, outside 1..{depth - 1} "
                f"(text_encoder/config.json has num_hidden_layers {depth}; the last layer cannot be used)"
            )
        hidden, joint = te.get("hidden_size"), tr.get("joint_attention_dim")
        if hidden is None or joint != hidden * len(layers):
            raise CheckpointError(
                f"{self.root}: the text encoder's hidden_size {hidden} x {len(layers)} out layers {layers} = "
                f"{hidden * len(layers) if hidden else '?'}, but transformer/config.json has joint_attention_dim "
                f"{joint}: the text encoder and the transformer are of different models "
                "(klein 4B: 2560 x 3 = 7680, klein 9B: 4096 x 3 = 12288)"
            )
        return tuple(layers)

    @property
    def is_kv(self) -> bool:
        """A KV checkpoint: its transformer is exported in the KV form (kv_cache.py)."""
        return self.model_index["_class_name"] == "Flux2KleinKVPipeline"

    @property
    def is_distilled(self) -> bool:
        # Flux2KleinKVPipeline is step-distilled only: it has no guidance and does not record it.
        return self.is_kv or self.model_index.get("is_distilled", False)

    def _check_scheduler(self):
        cfg = self.scheduler_config
        path = self.root / "scheduler" / "scheduler_config.json"
        unsupported = [
            key
            for key in (
                "use_karras_sigmas",
                "use_exponential_sigmas",
                "use_beta_sigmas",
                "invert_sigmas",
                "stochastic_sampling",
            )
            if cfg.get(key)
        ]
        if cfg.get("shift_terminal"):
            unsupported.append("shift_terminal")
        if cfg.get("time_shift_type", "exponential") not in ("exponential", "linear"):
            unsupported.append(f"time_shift_type={cfg.get('time_shift_type')}")
        if unsupported:
            raise CheckpointError(f"{path}: scheduler options not supported by klein: {', '.join(unsupported)}")
        # Numbers copied into the manifest: the runtime would refuse them later, without this file.
        steps = cfg.get("num_train_timesteps", 1000)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise CheckpointError(f"{path}: num_train_timesteps is {steps!r}; a whole number, at least 1 (1000)")
        shift = cfg.get("shift", 1.0)
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
            raise CheckpointError(f"{path}: shift is {shift!r}; a positive number (3.0)")
        distilled = self.model_index.get("is_distilled", False)
        if not isinstance(distilled, bool):
            raise CheckpointError(f"{self.root / 'model_index.json'}: is_distilled is {distilled!r}; true or false")

    def load_text_encoder(self, num_layers=None):
        """Qwen3 in float32; with `num_layers`, only the first layers are built and read (the
        weights of later layers are skipped on load: 27 of 36 layers of the 4B fit in 12 GB, not 16)."""
        from transformers import Qwen3ForCausalLM
        from transformers.utils import logging

        overrides = {}
        if num_layers is not None:
            layer_types = self.text_encoder_config.get("layer_types")
            overrides = {
                "num_hidden_layers": num_layers,
                **({"layer_types": layer_types[:num_layers]} if layer_types else {}),
            }
        verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
        logging.set_verbosity_error()  # the skipped layers' weights would be reported as unexpected keys
        logging.disable_progress_bar()  # "Loading weights: 100%|...|": the export prints its own progress
        try:
            return self._load(
                lambda: Qwen3ForCausalLM.from_pretrained(
                    self.root / "text_encoder", dtype=torch.float32, output_loading_info=True, **overrides
                ),
                "text_encoder",
                unused=TEXT_ENCODER_UNUSED,
            )
        finally:
            logging.set_verbosity(verbosity)
            if bar:
                logging.enable_progress_bar()

    def load_transformer(self):
        from diffusers import Flux2Transformer2DModel

        if self.transformer_file is not None:
            return single_file.load_transformer(self.transformer_file, self.transformer_config)
        return self._load(
            lambda: Flux2Transformer2DModel.from_pretrained(
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

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return self._load(lambda: (AutoTokenizer.from_pretrained(self.root / "tokenizer"), None), "tokenizer")

    def _load(self, loader, component, unused=()):
        """`loader()`'s model; it returns `(model, loading_info)` (None for the tokenizer). Weights
        in `unused` may be missing (the export never reads them)."""
        try:
            model, info = loader()
        except Exception as e:  # the libraries raise many types for a bad file; name the component
            raise CheckpointError(f"{self.root / component}: could not be loaded ({type(e).__name__}: {e})") from e
        # Weights the files lack: transformers would initialise them at random, diffusers leave
        # them without data; either way the export would not be this checkpoint's model.
        missing = sorted(set((info or {}).get("missing_keys", ())) - set(unused))
        check_complete(self.root / component, model, missing)
        if hasattr(model, "eval"):
            model.eval()
        return model


def check_complete(where, model, missing=()) -> None:
    """Refuses a loaded `model` whose weights `missing` (its loader's report) were not in the files,
    or that holds tensors without data (`meta`, as diffusers leaves what it did not find)."""
    if isinstance(model, torch.nn.Module):
        missing = list(missing) or [name for name, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise CheckpointError(
            f"{where}: its safetensors files lack {len(missing)} of the model's weights ({first_names(missing)}): "
            "they do not hold this component's weights (a wrong or partly copied file, or a config.json of "
            "another size?)"
        )
