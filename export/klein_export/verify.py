"""`klein-export verify`: torch against ONNX Runtime, component by component, at several shapes.

Each component is run by the torch wrapper (the same modules the exporter traced) and by ONNX Runtime
on the bundle's graph with identical inputs; the report gives max abs and relative error per case.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from .checkpoint import Checkpoint
from .manifest import HIDDEN_LAYERS
from .tokenizer_facts import tokenizer_facts
from .wrappers import TextEncoder, Transformer, VaeDecoder, VaeEncoder

# fp32 tolerance. A case passes when ORT's max abs error against torch fp32 is at most
# max(ABS_TOLERANCE, FLOOR_FACTOR * floor, REL_TOLERANCE * max|torch|), where floor is torch fp32's own
# max abs error against the same module run in float64 on the same inputs. Random-weight models with
# sharp attention amplify rounding: on the tiny checkpoint torch fp32 itself is 7.7e-3 away from
# float64 on embeddings of magnitude 21 (3.6e-4 relative), and ORT's float32 sin/cos of timestep*1000
# differs from torch's by an ulp, which the modulation amplifies to ~5e-5 relative in the velocity.
# A fixed 1e-5 would measure summation order, not the graph; a wrong layer or op gives errors of order 1.
ABS_TOLERANCE = 1e-5
FLOOR_FACTOR = 2.0
REL_TOLERANCE = 1e-4


@dataclass
class CaseResult:
    component: str
    case: str
    max_abs: float
    max_rel: float
    floor: float
    scale: float

    @property
    def tolerance(self) -> float:
        return max(ABS_TOLERANCE, FLOOR_FACTOR * self.floor, REL_TOLERANCE * self.scale)

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance

    def line(self) -> str:
        status = "ok" if self.ok else "FAIL"
        return (
            f"{self.component:13s} {self.case:38s} max_abs {self.max_abs:.2e}  rel {self.max_rel:.2e}  "
            f"torch-fp32-vs-fp64 {self.floor:.2e}  tol {self.tolerance:.2e}  {status}"
        )


def _session(bundle: Path, file: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(bundle / file), opts, providers=["CPUExecutionProvider"])


def _run_torch(module, args):
    """The module's fp32 output and its max abs error against the same module in float64."""
    with torch.no_grad():
        want = module(*args)
        module64 = copy.deepcopy(module).double()
        exact = module64(*[a.double() if a.is_floating_point() else a for a in args])
    return want, float((want.double() - exact).abs().max())


def _compare(component, case, module, args, got: np.ndarray) -> CaseResult:
    want, floor = _run_torch(module, args)
    want = want.numpy()
    if want.shape != got.shape:
        return CaseResult(component, f"{case} shape {got.shape} != {want.shape}", float("inf"), float("inf"), 0.0, 0.0)
    diff = float(np.abs(want.astype(np.float64) - got.astype(np.float64)).max())
    scale = max(float(np.abs(want).max()), 1e-30)
    return CaseResult(component, case, diff, diff / scale, floor, scale)


def _tokenize(tokenizer, facts, prompts):
    texts = [facts["prompt_prefix"] + p + facts["prompt_suffix"] for p in prompts]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=facts["max_sequence_length"], return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def verify_text_encoder(ckpt, bundle):
    tokenizer = ckpt.load_tokenizer()
    facts = tokenizer_facts(tokenizer)
    module = TextEncoder(ckpt.load_text_encoder(num_layers=max(HIDDEN_LAYERS)), HIDDEN_LAYERS).eval()
    sess = _session(bundle, "text_encoder.onnx")
    cases = {
        "batch 1, L 512": _tokenize(tokenizer, facts, ["a raccoon astronaut on the moon"]),
        "batch 2, L 512": _tokenize(tokenizer, facts, ["", "an 80s ski photo, grainy film, 日本語"]),
    }
    ids, mask = _tokenize(tokenizer, facts, ["short"])
    cases["batch 1, L 77"] = (ids[:, :77], mask[:, :77])
    for case, (ids, mask) in cases.items():
        got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        yield _compare("text_encoder", case, module, (ids, mask), got)


def _latent_ids(h, w, t=0):
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.full_like(ys, t).flatten(), ys.flatten(), xs.flatten(), torch.zeros_like(ys).flatten()], dim=1)


def verify_transformer(ckpt, bundle):
    model = ckpt.load_transformer()
    module = Transformer(model).eval()
    cfg = model.config
    sess = _session(bundle, "transformer.onnx")
    g = torch.Generator().manual_seed(1)
    cases = {
        "batch 1, 4x4, L 512": (1, (4, 4), [], 512),
        "batch 2, 3x5, L 64": (2, (3, 5), [], 64),
        "batch 1, 4x4 + refs 2x3, 5x4, L 512": (1, (4, 4), [(2, 3), (5, 4)], 512),
        "batch 2, 2x6 + ref 3x3, L 32": (2, (2, 6), [(3, 3)], 32),
    }
    for case, (b, (h, w), refs, seq) in cases.items():
        ids = [_latent_ids(h, w)] + [_latent_ids(rh, rw, 10 + 10 * i) for i, (rh, rw) in enumerate(refs)]
        img_ids = torch.cat(ids, dim=0)
        txt_ids = torch.stack([torch.zeros(seq, dtype=torch.int64)] * 3 + [torch.arange(seq)], dim=1)
        latents = torch.randn(b, img_ids.shape[0], cfg.in_channels, generator=g)
        embeds = torch.randn(b, seq, cfg.joint_attention_dim, generator=g)
        timestep = torch.rand(b, generator=g)
        feeds = {"latents": latents, "prompt_embeds": embeds, "timestep": timestep, "img_ids": img_ids, "txt_ids": txt_ids}
        got = sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
        yield _compare("transformer", case, module, tuple(feeds.values()), got)


def verify_vae(ckpt, bundle):
    vae = ckpt.load_vae()
    enc, dec = VaeEncoder(vae).eval(), VaeDecoder(vae).eval()
    enc_sess, dec_sess = _session(bundle, "vae_encoder.onnx"), _session(bundle, "vae_decoder.onnx")
    g = torch.Generator().manual_seed(2)
    for b, h, w in ((1, 64, 64), (2, 48, 80), (1, 96, 32)):
        image = torch.rand(b, 3, h, w, generator=g) * 2 - 1
        got = enc_sess.run(None, {"image": image.numpy()})[0]
        yield _compare("vae_encoder", f"batch {b}, {h}x{w}", enc, (image,), got)
    latent_ch = vae.config.latent_channels * 4
    for b, h, w in ((1, 4, 4), (2, 3, 5), (1, 6, 2)):
        latents = torch.randn(b, latent_ch, h, w, generator=g)
        got = dec_sess.run(None, {"latents": latents.numpy()})[0]
        yield _compare("vae_decoder", f"batch {b}, {h}x{w} latents", dec, (latents,), got)


def verify(checkpoint, bundle):
    """Yields one CaseResult per component and shape."""
    ckpt = Checkpoint(checkpoint)
    bundle = Path(bundle)
    for step in (verify_text_encoder, verify_transformer, verify_vae):
        yield from step(ckpt, bundle)
