"""Step previews: a linear map from the transformer's latent tokens to RGB, fitted on the VAE.

A packed latent token is 128 normalised channels: 32 VAE channels at 2x2 latent cells (channel
`c * 4 + dy * 2 + dx`), each cell 8x8 pixels. For each of the 4 cells, the fit maps its 32
channels to the mean colour of its 8x8 pixels (ridge least squares with a bias), on the latents
the bundle's own VAE encoder gives for a set of synthetic images (gradients, discs, stripes and
noise in many colours). The runtime then previews an image at 1/8 of its size with 12 multiply-adds
per channel per token: nothing next to a denoising step. `fit_rmse` records how well the map
reproduces those images' colours (0-1 scale).
"""

import numpy as np
import torch

from .fixtures import synthetic_image

PREVIEW_IMAGES = 24
PREVIEW_SIZE = 256
RIDGE = 1e-3


def _images(count: int, size: int) -> torch.Tensor:
    """`[count, 3, size, size]` in [-1, 1]: synthetic images with their channels shuffled and
    scaled, so that every hue and brightness appears."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        rgb = np.asarray(synthetic_image(size, size, "RGB", seed=i), dtype=np.float32) / 255
        rgb = rgb[:, :, rng.permutation(3)] * rng.uniform(0.4, 1.0, 3) + rng.uniform(0, 0.3, 3)
        out.append(np.clip(rgb, 0, 1).transpose(2, 0, 1))
    return torch.from_numpy(np.stack(out)).float() * 2 - 1


def fit_preview(vae, count: int = PREVIEW_IMAGES, size: int = PREVIEW_SIZE) -> dict:
    """The manifest's `preview` section for the VAE `vae` (an `AutoencoderKLFlux2`)."""
    from .wrappers import VaeEncoder

    encoder = VaeEncoder(vae.float().eval())
    images = _images(count, size)
    with torch.no_grad():
        latents = torch.cat([encoder(images[i : i + 4]) for i in range(0, count, 4)])  # [N, 128, h, w]
    colours = (images + 1) / 2
    cells = torch.nn.functional.avg_pool2d(colours, 8)  # [N, 3, 2h, 2w]: one colour per latent cell
    patch = latents.shape[1] // 4
    weights = np.zeros((latents.shape[1], 3))
    bias = np.zeros((4, 3))
    residual = 0.0
    for p in range(4):
        dy, dx = divmod(p, 2)
        x = latents[:, p::4].permute(0, 2, 3, 1).reshape(-1, patch).double().numpy()  # [M, 32]
        y = cells[:, :, dy::2, dx::2].permute(0, 2, 3, 1).reshape(-1, 3).double().numpy()  # [M, 3]
        design = np.hstack([x, np.ones((len(x), 1))])
        gram = design.T @ design + RIDGE * len(x) * np.diag([1.0] * patch + [0.0])
        solution = np.linalg.solve(gram, design.T @ y)  # [33, 3]
        weights[p::4] = solution[:patch]
        bias[p] = solution[patch]
        residual += float(np.mean((design @ solution - y) ** 2)) / 4
    return {
        "weights": weights.round(7).tolist(),
        "bias": bias.round(7).tolist(),
        "fit_rmse": round(residual**0.5, 5),
    }


def add_preview(checkpoint, bundle) -> dict:
    """`klein-export preview`: fits the preview map of `checkpoint`'s VAE and writes it into the
    manifest of `bundle`, exported from that checkpoint (the graphs are not touched)."""
    from pathlib import Path

    from .checkpoint import Checkpoint
    from .manifest import check_bundle_of, read_manifest, write_manifest

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    ckpt = Checkpoint(checkpoint)
    check_bundle_of(manifest, bundle, ckpt)
    vae = ckpt.load_vae()
    _check_decoder_of(bundle / manifest["graphs"]["vae_decoder"]["file"], vae, ckpt.root)
    manifest["preview"] = fit_preview(vae)
    write_manifest(manifest, bundle)
    return manifest["preview"]


def _check_decoder_of(graph, vae, root):
    """BundleError unless the decoder graph at `graph` holds `vae`'s output convolution (float32,
    or its float16 rounding): checkpoints of one size differ only in their weights, and a map
    fitted on another VAE would colour every preview wrongly. That convolution stays float in
    every precision (`--method static` leaves it so)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from .errors import BundleError

    want = vae.decoder.conv_out.weight.detach().float().numpy()
    rounded = want.astype(np.float16).astype(np.float32)
    for tensor in onnx.load(str(graph)).graph.initializer:
        if tuple(tensor.dims) == want.shape:
            value = numpy_helper.to_array(tensor).astype(np.float32)
            if np.array_equal(value, want) or np.array_equal(value, rounded):
                return
    raise BundleError(
        f"{graph}: its weights are not those of the VAE of {root} (the output convolution differs): "
        "the bundle was exported from another checkpoint; give that one"
    )
