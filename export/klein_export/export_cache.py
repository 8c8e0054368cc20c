"""A cache of exported components (`klein-export convert --cache DIR`).

Converting the same checkpoint again with other transformer options (a LoRA merged at export, a
fine-tuned transformer file, another checkpoint's VAE) exports the text encoder and the VAE again,
and the text encoder is most of a convert's time. With a cache directory, each component's graph
files are kept there under a key of everything its export reads, and a later convert with the same
key copies them instead of exporting.

The key is a sha256 of:
- the component's files in the checkpoint, by content (the text encoder with the tokenizer, the
  transformer or the transformer file given instead, the VAE), and `model_index.json`;
- the options that change the graph: precision, fused operators (off for static shapes), and for
  the transformer the LoRAs merged into it (each file's sha256 and scale);
- the exporter: the source of `klein_export` and the versions of torch, transformers, diffusers,
  onnx, onnxscript and onnxruntime.

Entries hold pickled graph descriptions: give a directory that only you write to. Entries are
written whole or not at all (a folder renamed into place), and a lock file per key lets
two converts share an entry: the second waits for the first's export, then copies it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

from filelock import FileLock

ENTRIES = "entries.pickle"
# The checkpoint folders each component's export reads.
FOLDERS = {"text_encoder": ("text_encoder", "tokenizer"), "transformer": ("transformer",), "vae": ("vae",)}


def _hash_file(digest, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)


def _exporter_digest() -> str:
    import diffusers
    import onnx
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    digest = hashlib.sha256()
    for module in (torch, transformers, diffusers, onnx, onnxscript, onnxruntime):
        digest.update(f"{module.__name__}={module.__version__}\n".encode())
    source = Path(__file__).parent
    for path in sorted(source.rglob("*.py")):
        digest.update(path.relative_to(source).as_posix().encode())
        _hash_file(digest, path)
    return digest.hexdigest()


def component_key(ckpt, label: str, precision: str, loras, fused: bool) -> str:
    """The cache key of exporting `label` of the Checkpoint `ckpt` with these options."""
    digest = hashlib.sha256()
    options = {"component": label, "precision": precision, "fused": fused, "exporter": _exporter_digest()}
    if label == "transformer":
        options["loras"] = [lora.to_json() for lora in loras]
    digest.update(json.dumps(options, sort_keys=True).encode())
    # FLUX.3 checkpoints (flux3.Flux3Checkpoint) may have modular_model_index.json instead, and no
    # single transformer file.
    files = [getattr(ckpt, "index_path", ckpt.root / "model_index.json")]
    for folder in FOLDERS[label]:
        if label == "transformer" and getattr(ckpt, "transformer_file", None) is not None:
            files += [ckpt.root / folder / "config.json", Path(ckpt.transformer_file)]
            continue
        files += sorted(p for p in (ckpt.root / folder).rglob("*") if p.is_file())
    for path in files:
        name = path.relative_to(ckpt.root).as_posix() if path.is_relative_to(ckpt.root) else "transformer file"
        digest.update(f"\0{name}\0".encode())
        _hash_file(digest, path)
    return digest.hexdigest()


@contextlib.contextmanager
def locked(cache: Path, key: str):
    """Holds the key's lock: one convert exports an entry while the others wait for it."""
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f"{key}.lock")):
        yield


def fetch(cache: Path, key: str, out: Path):
    """The entry's GraphEntry list, its files copied into `out`; None when the cache has no entry."""
    entry = cache / key
    try:
        entries = pickle.loads((entry / ENTRIES).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        return None
    for path in entry.iterdir():
        if path.name != ENTRIES:
            shutil.copyfile(path, out / path.name)
    return entries


def store(cache: Path, key: str, out: Path, names, entries) -> None:
    """Keeps the files `names` of `out`, and `entries`, as the key's entry."""
    partial = cache / f"{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in names:
        shutil.copyfile(out / name, partial / name)
    (partial / ENTRIES).write_bytes(pickle.dumps(entries))
    shutil.rmtree(cache / key, ignore_errors=True)
    os.replace(partial, cache / key)
